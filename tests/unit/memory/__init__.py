"""Unit tests of `stagectl.memory`, named after its modules or topics."""
