"""stagectl.rollout.engines."""
