"""Shared by the vLLM tier: where the vLLM CPU environment is (`.venv-vllm`, made by `make vllm-env`),
and the rule when it is missing: skip, unless `STAGECTL_REQUIRE_VLLM=1` (then the tier fails)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
REQUIRE_ENV = "STAGECTL_REQUIRE_VLLM"


def vllm_python() -> Path:
    """The vLLM environment's interpreter (`$STAGECTL_VLLM_VENV`, default `.venv-vllm` in the checkout)."""
    venv = Path(os.environ.get("STAGECTL_VLLM_VENV", str(ROOT / ".venv-vllm")))
    return venv / "bin" / "python"


def require_vllm_python() -> Path:
    """`vllm_python()`, or skip (fail under `STAGECTL_REQUIRE_VLLM=1`) when it does not exist."""
    python = vllm_python()
    if not python.is_file():
        reason = f"no vLLM environment at {python.parents[1]}: run `make vllm-env` to create it"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason} ({REQUIRE_ENV}=1)")
        pytest.skip(reason)
    return python
