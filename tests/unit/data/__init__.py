"""Unit tests of `stagectl.data`, named after its modules or topics."""
