"""Unit tests of `stagectl.models`, named after its modules or topics."""
