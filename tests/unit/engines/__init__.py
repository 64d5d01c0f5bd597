"""Unit tests of `stagectl.engines`, named after its modules or topics."""
