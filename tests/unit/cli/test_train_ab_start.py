"""A train-ab start refused before it writes anything: a model train-ab cannot train (a text-only
checkpoint) fails in the launcher, before the run directory, a server or a weight load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import pytest
from typer.testing import CliRunner

from stagectl.cli.app import app

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples/tiny/train_ab.yaml"


def test_a_text_only_model_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stagectl.cli.train_ab  # light: the trainer (torch) is imported only when a run trains

    def no_training(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError("the run started (and would load the model) for a text-only model")

    monkeypatch.setattr(stagectl.cli.train_ab, "_train", no_training)
    for name in ("STAGECTL_LAUNCHED", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    text_only = tmp_path / "qwen3"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    out = tmp_path / "runs" / "x"
    sets = [f"model.name_or_path={text_only}", f"training.output_dir={out}"]
    result = CliRunner().invoke(app, ["train-ab", str(TINY), *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 1, result.output
    assert (
        f"error: model.name_or_path: {text_only} is a text-only qwen3 model (config.json has no "
        "vision_config): train-ab trains detection on images and needs a Qwen-VL model"
    ) in result.output
    assert not (tmp_path / "runs").exists()
