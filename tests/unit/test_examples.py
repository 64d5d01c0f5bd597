"""Every shipped example config validates."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagectl.config import load_config

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").rglob("*.yaml"))


def test_examples_exist() -> None:
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(path)
    assert cfg.model.name_or_path


def _documented_commands(path: Path) -> list[list[str]]:
    """The `stagectl train-ab ...` commands in an example's header comment (`\\` continues a line)."""
    text = "\n".join(
        line.removeprefix("#").strip() for line in path.read_text().splitlines() if line.startswith("#")
    )
    commands = text.replace("\\\n", " ").splitlines()
    return [c.split() for c in commands if c.startswith("stagectl train-ab ")]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_documented_runs_of_an_example_use_separate_run_directories(path: Path) -> None:
    """Run one after the other as written, no command's run may land in another's directory (the second
    would be refused, or, before that rule, destroy the first)."""
    out_dirs = []
    for argv in _documented_commands(path):
        sets = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
        out_dirs.append(load_config(path, sets).training.output_dir)
    assert len(out_dirs) == len(set(out_dirs)), out_dirs


def test_the_learning_check_documents_an_a_only_and_an_ab_run() -> None:
    path = next(p for p in EXAMPLES if p.name == "learn_shapes.yaml")
    assert len(_documented_commands(path)) == 2
