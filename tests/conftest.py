"""Test tiers: markers follow the directory, `gpu` skips without CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TIERS = {
    "integration": "integration",
    "vllm": "vllm",
    "interop": "interop",
    "gpu": "gpu",
    "faults": "integration",
}

# Keep the tiny-model cache inside the test session's reach but shared across tests (built once).
os.environ.setdefault("STAGECTL_CACHE_DIR", str(Path.home() / ".cache" / "stagectl"))
# One intra-op thread per process: the tiny model gains nothing from more on 2 cores, and test
# subprocesses (servers, torchrun ranks) would otherwise oversubscribe the machine badly.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = _cuda_available()
    for item in items:
        parts = Path(str(item.fspath)).parts
        for directory, marker in TIERS.items():
            if directory in parts:
                item.add_marker(getattr(pytest.mark, marker))
        if "gpu" in parts and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False here"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
