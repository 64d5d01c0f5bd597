"""Benchmarks. Each module runs alone (`python -m bench.bench_matching`) and exposes `run() -> dict`."""
