"""stagectl.cli."""
