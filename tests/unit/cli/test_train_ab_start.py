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


def _refused_before_the_run(monkeypatch: pytest.MonkeyPatch, sets: list[str]) -> str:
    """train-ab's output for `sets` on the tiny example with an embedded rollout server, asserting that it
    exits 1 before the server starts or a rank loads the model (both are replaced by a failure)."""
    import stagectl.cli.train_ab
    import stagectl.launch

    def started(what: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> NoReturn:
            raise AssertionError(f"{what} started; the launcher should have refused the config")

        return refuse

    monkeypatch.setattr(stagectl.cli.train_ab, "_train", started("the run (a model load)"))
    monkeypatch.setattr(stagectl.launch, "embedded_rollout_server", started("the embedded rollout server"))
    for name in ("STAGECTL_LAUNCHED", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    server = [
        "rollout_server.embedded=true",
        "custom.extra.rollout_matching.rollout_backend=vllm",
        "custom.extra.rollout_matching.vllm.mode=server",
    ]
    result = CliRunner().invoke(
        app, ["train-ab", str(TINY), *[a for s in [*server, *sets] for a in ("--set", s)]]
    )
    assert result.exit_code == 1, result.output
    return result.output


def test_a_held_out_split_that_cannot_be_read_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """data.eval.jsonl was first read by rank 0's evaluator, after the embedded server and the model had
    loaded (minutes on a real model); a missing file, a bad line or a missing image now fails at once."""
    out = tmp_path / "runs" / "x"
    split = tmp_path / "eval.jsonl"
    line = {
        "images": ["gone.png"],
        "width": 112,
        "height": 112,
        "objects": [{"desc": "a", "bbox_2d": [1, 1, 5, 5]}],
    }
    split.write_text(json.dumps(line) + "\n")
    for jsonl, said in (
        (tmp_path / "missing.jsonl", f"{tmp_path / 'missing.jsonl'}: no such file"),
        (split, f"{split}:1: image not found: {tmp_path / 'gone.png'}"),
    ):
        output = _refused_before_the_run(
            monkeypatch, [f"data.eval.jsonl={jsonl}", f"training.output_dir={out}"]
        )
        assert f"error: data.eval.jsonl: {said}" in output
    assert not (tmp_path / "runs").exists()


def test_a_resume_from_a_checkpoint_that_is_not_there_is_refused_before_the_server_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume_from_checkpoint path that does not exist (or is no complete checkpoint) was refused by the
    ranks, after the embedded server had loaded its model, leaving the server's log in the run dir."""
    out = tmp_path / "runs" / "x"
    missing = tmp_path / "checkpoint-7"
    output = _refused_before_the_run(
        monkeypatch, [f"training.resume_from_checkpoint={missing}", f"training.output_dir={out}"]
    )
    assert f"error: training.resume_from_checkpoint: {missing} does not exist" in output
    missing.mkdir()  # there, without its trainer_state.json
    output = _refused_before_the_run(
        monkeypatch, [f"training.resume_from_checkpoint={missing}", f"training.output_dir={out}"]
    )
    assert f"error: training.resume_from_checkpoint: {missing} is not a complete checkpoint" in output
    assert not (tmp_path / "runs").exists()
