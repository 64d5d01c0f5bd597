"""stagectl.stage_b."""
