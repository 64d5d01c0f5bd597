"""Unit tests of `stagectl.rollout`, named after its modules or topics."""
