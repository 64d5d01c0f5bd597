"""stagectl.detection."""
