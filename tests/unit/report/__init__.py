"""Unit tests of `stagectl.report`, named after its modules or topics."""
