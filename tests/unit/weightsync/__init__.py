"""Unit tests of `stagectl.weightsync`, one module per module where it has one."""
