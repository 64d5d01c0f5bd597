"""Unit tests of `stagectl.detection`, named after its modules or topics."""
