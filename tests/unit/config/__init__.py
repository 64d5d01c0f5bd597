"""Unit tests of `stagectl.config`, named after its modules or topics."""
