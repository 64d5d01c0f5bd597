"""Shared by the interop tier: where the ms-swift environment is (`.venv-interop`, made by `make
interop-env`), the rule when it is missing (skip, unless `STAGECTL_REQUIRE_INTEROP=1`: then the tier
fails), and running `swift_side.py` there."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
SWIFT_SIDE = Path(__file__).with_name("swift_side.py")
REQUIRE_ENV = "STAGECTL_REQUIRE_INTEROP"


def require_interop_python() -> Path:
    """The ms-swift environment's interpreter (`$STAGECTL_INTEROP_VENV`, default `.venv-interop` in the
    checkout), or skip (fail under `STAGECTL_REQUIRE_INTEROP=1`) when it does not exist."""
    # a relative path (the Makefile passes `.venv-interop`) is the checkout's, whatever the working directory
    venv = ROOT / os.environ.get("STAGECTL_INTEROP_VENV", ".venv-interop")
    python = venv / "bin" / "python"
    if not python.is_file():
        reason = f"no ms-swift environment at {venv}: run `make interop-env` to create it"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason} ({REQUIRE_ENV}=1)")
        pytest.skip(reason)
    return python


def swift_client(python: Path, url: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Send `cases` through swift's own `VLLMInferClient` (see `swift_side.py`); one result per case."""
    done = subprocess.run(
        [str(python), str(SWIFT_SIDE), "client", url],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=180,
        cwd="/",  # the checkout must not shadow anything in swift's environment
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout)
    assert isinstance(results, list) and len(results) == len(cases)
    return results
