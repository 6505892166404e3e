"""`python -m megazero.config schema | docs-table [--write docs/engine.md] | deepspeed-keys [--write
configs/deepspeed_keys.json]`: see megazero.config.schema."""

from megazero.config.schema import main

main()
