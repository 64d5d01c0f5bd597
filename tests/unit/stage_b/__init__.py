"""Unit tests of `stagectl.stage_b`, named after its modules or topics."""
