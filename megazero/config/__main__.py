"""`python -m megazero.config schema | docs-table [--write docs/engine.md]`: see megazero.config.schema."""

from megazero.config.schema import main

main()
