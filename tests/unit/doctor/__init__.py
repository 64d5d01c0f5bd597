"""Unit tests of `stagectl.doctor`, named after its modules or topics."""
