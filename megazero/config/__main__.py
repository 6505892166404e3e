"""`python -m megazero.config schema | readme-table [--write README.md]`: see megazero.config.schema."""

from megazero.config.schema import main

main()
