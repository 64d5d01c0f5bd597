"""Unit tests of `stagectl.learner`, named after its modules or topics."""
