"""`python -m stagectl` runs the CLI."""

from stagectl.cli.app import main

main()
