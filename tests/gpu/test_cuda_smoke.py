"""GPU tier: runs only where CUDA is available (skipped elsewhere by tests/conftest.py)."""

from __future__ import annotations

import torch


def test_cuda_matmul_matches_cpu() -> None:
    a = torch.randn(64, 64)
    b = torch.randn(64, 64)
    expected = a @ b
    got = (a.cuda() @ b.cuda()).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
