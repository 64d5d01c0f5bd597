"""Unit tests of `stagectl.wire`, named after its modules or topics."""
