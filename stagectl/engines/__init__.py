"""stagectl.engines."""
