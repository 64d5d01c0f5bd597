"""Unit tests of `stagectl.rollout.server`, named after its modules or topics."""
