"""Unit tests of the benchmark harness (`bench/`)."""
