"""Unit tests of `stagectl.cli`, named after its modules or topics."""
