"""Every fault of the injection hook still finds what it patches: a refactor that moves a seam (the weight
push left `AsyncChannelB` for `WeightPublisher` once) must fail here by name, not as an unexplained run
failure in a slow fault test."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.helpers import INJECT_DIR

# one spec per fault, armed for rank 0 so the rank-conditional patches run
SPECS = [
    "raise_in_micro_step:0:1",
    "kill_in_checkpoint:1",
    "kill_in_sync:1:0",
    "kill_in_broadcast:1",
    "kill_in_infer:1",
    "stop_in_micro_step:0:1",
    "stop_in_push:1",
    "resume_view:0",
    "log_stream:a",
    "slow_prefetch:0:0",
    "raise_in_prefetch:0",
    "slow_infer:0",
    "raise_in_judge:0:0",
    "kill_at_step:1",
    "kill_in_push:1",
    "wait_for_packs:1",
]


def test_every_fault_is_listed_here() -> None:
    spec = importlib.util.spec_from_file_location("_fault_hook", INJECT_DIR / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)  # arms nothing: STAGECTL_FAULT_DIR is unset in the test process
    assert {s.split(":")[0] for s in SPECS} == set(hook.FAULTS)


@pytest.mark.parametrize("spec", SPECS)
def test_fault_patches_its_target(tmp_path: Path, spec: str) -> None:
    code = (
        "import sys, sitecustomize\n"
        "name = sys.argv[1].split(':')[0]\n"
        "target, _ = sitecustomize.FAULTS[name]\n"
        "import importlib; importlib.import_module(target)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(INJECT_DIR), os.environ.get("PYTHONPATH", "")]),
        "STAGECTL_FAULT_DIR": str(tmp_path),
        "STAGECTL_FAULT": spec,
        "RANK": "0",
    }
    out = subprocess.run(
        [sys.executable, "-c", code, spec], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert not list(tmp_path.glob("fault-*.json"))  # patched, not fired
