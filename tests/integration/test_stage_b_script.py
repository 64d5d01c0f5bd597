"""scripts/stage_b.sh finds stagectl without an activated virtual environment (a copy of the script in a
scratch repository layout, a stub stagectl that echoes its arguments: no model runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "stage_b.sh"


def _layout(tmp_path: Path, with_venv: bool) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "stage_b.sh")
    if with_venv:
        stub = tmp_path / ".venv" / "bin" / "stagectl"
        stub.parent.mkdir(parents=True)
        stub.write_text('#!/usr/bin/env bash\necho "venv stagectl $*"\n')
        stub.chmod(0o755)
    return tmp_path


def _run(repo: Path, **env: str) -> subprocess.CompletedProcess[str]:
    path = "/usr/bin:/bin"  # no stagectl on it: what a shell without `source .venv/bin/activate` has
    assert shutil.which("stagectl", path=path) is None
    return subprocess.run(
        ["bash", "scripts/stage_b.sh", "--set", "runner.epochs=2"],
        cwd=repo,
        env={"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), "config": "cfg.yaml", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_uses_the_repository_venv_when_stagectl_is_not_on_the_path(tmp_path: Path) -> None:
    result = _run(_layout(tmp_path, with_venv=True), nproc="2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "venv stagectl stage-b cfg.yaml --nproc 2 --set runner.epochs=2"


def test_says_how_to_get_stagectl_when_there_is_none(tmp_path: Path) -> None:
    result = _run(_layout(tmp_path, with_venv=False))
    assert result.returncode == 127
    assert "make install" in result.stderr and "STAGECTL=" in result.stderr


def test_stagectl_variable_wins(tmp_path: Path) -> None:
    repo = _layout(tmp_path, with_venv=False)
    other = tmp_path / "elsewhere"
    other.write_text('#!/usr/bin/env bash\necho "chosen $*"\n')
    other.chmod(0o755)
    result = _run(repo, STAGECTL=str(other))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("chosen stage-b cfg.yaml")
