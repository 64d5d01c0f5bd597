"""Every fault of the injection hook still finds what it patches: a refactor that moves a seam (the weight
push left `AsyncChannelB` for `WeightPublisher` once) must fail here by name, not as an unexplained run
failure in a slow fault test."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

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


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_fault_hook", INJECT_DIR / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)  # arms nothing: STAGECTL_FAULT_DIR is unset in the test process
    return hook


def _groups() -> list[list[str]]:
    """SPECS in as few groups as hold each target module once (two faults patching one module cannot be
    armed in one process: the first hook to find the module hides it from the other)."""
    targets = _hook().FAULTS
    groups: list[list[str]] = []
    for spec in SPECS:
        target = targets[spec.split(":")[0]][0]
        free = [g for g in groups if target not in {targets[s.split(":")[0]][0] for s in g}]
        if free:
            free[0].append(spec)
        else:
            groups.append([spec])
    return groups


def test_every_fault_is_listed_here() -> None:
    assert {s.split(":")[0] for s in SPECS} == set(_hook().FAULTS)


# One process per group, every fault of the group armed (`;`), each target imported in turn: a patch that
# no longer finds its attribute fails that import, and the child names the fault; a hook that never saw
# its module (moved, renamed) is named too.
_CHILD = r"""
import importlib, sys, traceback
import sitecustomize
failed = []
for spec in sys.argv[1:]:
    target, _ = sitecustomize.FAULTS[spec.split(":")[0]]
    try:
        importlib.import_module(target)
    except Exception:
        failed.append(f"{spec}: patching {target} failed:\n{traceback.format_exc()}")
hooks = [f for f in sys.meta_path if isinstance(f, sitecustomize._PatchAfterImport)]
failed += [f"{h.target}: the hook never saw the module imported" for h in hooks if h._loader is None]
assert len(hooks) == len(sys.argv) - 1, hooks
sys.exit("\n".join(failed) or None)
"""


@pytest.mark.parametrize("group", _groups(), ids=lambda g: f"{len(g)}-faults-from-{g[0].split(':')[0]}")
def test_fault_patches_its_target(tmp_path: Path, group: list[str]) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(INJECT_DIR), os.environ.get("PYTHONPATH", "")]),
        "STAGECTL_FAULT_DIR": str(tmp_path),
        "STAGECTL_FAULT": ";".join(group),
        "RANK": "0",
    }
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, *group], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert not list(tmp_path.glob("fault-*.json"))  # patched, not fired
