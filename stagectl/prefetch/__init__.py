"""stagectl.prefetch."""
