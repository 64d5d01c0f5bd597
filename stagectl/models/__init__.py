"""stagectl.models."""
