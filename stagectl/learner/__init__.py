"""stagectl.learner."""
