"""Unit tests of `stagectl.inference`, named after its modules or topics."""
