"""stagectl.config."""
