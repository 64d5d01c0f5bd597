"""What the GPU tier needs, each as a skip with its own reason: a number of CUDA devices, flash-attn,
a CUDA build of vLLM. (tests/conftest.py already skips the whole tier without CUDA.)"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.vllm.helpers import vllm_python


def require_gpus(count: int) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < count:
        pytest.skip(f"needs {count} CUDA GPUs, this machine has {have}")


def require_attn(attn: str) -> None:
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (pip install flash-attn)")


@functools.cache
def _vllm_cuda_problem(python: str) -> str | None:
    probe = "import torch, vllm; raise SystemExit(0 if torch.cuda.is_available() else 3)"
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    if done.returncode == 3:
        return f"vLLM in {python} is a CPU build (torch.cuda.is_available() is False there)"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"vLLM is not installed for {python} ({last})"
    return None


def require_vllm_cuda() -> Path:
    """The interpreter that imports a CUDA build of vLLM: `$STAGECTL_VLLM_VENV` / `.venv-vllm` where it
    exists, else this one; skip, naming why, when it cannot."""
    python = vllm_python() if vllm_python().is_file() else Path(sys.executable)
    problem = _vllm_cuda_problem(str(python))
    if problem is not None:
        pytest.skip(problem)
    return python


def cpu_only_env() -> dict[str, str]:
    """Environment for a subprocess that must run on the CPU (a float32 reference run)."""
    return {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
