"""stagectl.data."""
