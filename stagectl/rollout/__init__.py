"""stagectl.rollout."""
