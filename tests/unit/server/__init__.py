"""Unit tests of `stagectl.server`, named after its modules or topics."""
