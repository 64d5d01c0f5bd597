"""Unit tests of `stagectl.prefetch`, named after its modules or topics."""
