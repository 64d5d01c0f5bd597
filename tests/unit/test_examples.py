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
