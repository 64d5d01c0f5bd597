"""Unit tests of `stagectl.learner.channel_b`, named after its modules or topics."""
