"""Unit tests of `stagectl.rollout.server.engines`, named after its modules or topics."""
