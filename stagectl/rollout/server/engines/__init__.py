"""stagectl.rollout.server.engines."""
