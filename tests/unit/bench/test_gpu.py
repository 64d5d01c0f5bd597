"""`python -m bench gpu` off a GPU, and its peak-FLOPs table (MFU's denominator) by device name."""

from __future__ import annotations

import pytest
import torch

from bench.bench_gpu import peak_tflops, run


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),  # SXM
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Tesla T4", None),  # unknown: no MFU rather than a wrong one
    ],
)
def test_peak_tflops_by_device_name(name: str, peak: float | None) -> None:
    assert peak_tflops(name) == peak


def test_without_cuda_it_says_so_and_measures_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run() is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "needs CUDA" in out[0]
