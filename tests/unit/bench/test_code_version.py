"""`bench.common.code_version`: a benchmark's page names the commit it measured, and says so when the
tracked code differed from it, its own outputs aside (the learning check recorded on 2026-11-28 named no
code, and its Stage-1 is not what that day's commit trains from the same config)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from bench.common import code_version


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout


def test_the_commit_measured_and_uncommitted_code_are_told_apart(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    for path in ("code/x.py", "bench/results/learning.json", "BENCHMARKS.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("a\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    sha = _git(tmp_path, "rev-parse", "--short", "HEAD").strip()

    assert code_version(tmp_path) == sha
    (tmp_path / "bench/results/learning.json").write_text("b\n")  # what the benchmark itself writes
    (tmp_path / "BENCHMARKS.md").write_text("b\n")
    (tmp_path / "scratch.txt").write_text("untracked\n")
    assert code_version(tmp_path) == sha
    (tmp_path / "code/x.py").write_text("b\n")  # the measured code, changed and not committed
    assert code_version(tmp_path) == f"{sha}+uncommitted"
    assert code_version(tmp_path / "nowhere") == "unknown"


def test_the_page_names_the_code_a_result_measured(tmp_path: Path, monkeypatch: Any) -> None:
    from bench import document

    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    saved = json.loads((document.RESULTS / "cli.json").read_text())
    saved["meta"]["code"] = "abc1234+uncommitted"
    (results / "cli.json").write_text(json.dumps(saved))
    monkeypatch.setattr(document, "ROOT", tmp_path)
    monkeypatch.setattr(document, "RESULTS", results)
    monkeypatch.setattr(document, "plot", lambda name, result: None)
    document.write_markdown()
    page = (tmp_path / "BENCHMARKS.md").read_text()
    assert f"_Ran {saved['meta']['ran_at']}, code abc1234+uncommitted, " in page
