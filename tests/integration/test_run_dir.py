"""A run directory never loses a finished run: a second train-ab into it is refused byte for byte; --resume
continues it (each step's metrics row exactly once); --overwrite moves it aside whole."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from stagectl.config.plan_train import read_train_plan
from tests.integration.helpers import read_metrics, run_cli, tiny_train_config, write_config


def hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def umask_022():
    old = os.umask(0o022)  # the runs below inherit it
    yield
    os.umask(old)


def test_refused_then_resumed_then_overwritten(tmp_path: Path, umask_022: None) -> None:
    cfg = tiny_train_config(
        tmp_path,
        training={"max_steps": 4, "save_steps": 2},
        stage2_ab={"schedule": {"b_ratio": 0.0}},
        data={"eval": {"synthetic": {"num_samples": 2, "seed": 5, "max_objects": 1}, "every_steps": 2}},
    )
    config = write_config(tmp_path / "cfg.yaml", cfg)
    out = tmp_path / "run"
    first = run_cli("train-ab", str(config))
    assert first.returncode == 0, first.stderr[-3000:]
    finished = read_metrics(out)
    assert [r["step"] for r in finished] == [0, 1, 2, 3]
    # files others can read: config.yaml (atomic writer) and the checkpoint's model (save_pretrained: 0600)
    assert stat.S_IMODE((out / "config.yaml").stat().st_mode) == 0o644
    assert stat.S_IMODE((out / "checkpoint-4" / "model" / "model.safetensors").stat().st_mode) == 0o644
    before = hashes(out)

    # a new 2-step run into the finished run's directory: refused, not a byte changed, nothing created
    second = run_cli("train-ab", str(config), "--set", "training.max_steps=2")
    assert second.returncode == 1
    assert "training.output_dir" in second.stderr and "already holds a run" in second.stderr
    assert (
        "4 metrics rows" in second.stderr and "--resume" in second.stderr and "--overwrite" in second.stderr
    )
    assert "Traceback" not in second.stderr
    assert hashes(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml", "run"]

    # continue it from checkpoint-2: rows 2 and 3 are replaced by the re-run steps, not appended twice
    resumed = run_cli(
        "train-ab",
        str(config),
        "--resume",
        "--set",
        f"training.resume_from_checkpoint={out / 'checkpoint-2'}",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-2'}: 2 optimizer steps done, continuing with step 3 of 4" in (
        resumed.stderr
    )
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[:2] == finished[:2]  # kept as they were
    for again, original in zip(rows[2:], finished[2:], strict=True):
        assert again["loss"] == pytest.approx(original["loss"], rel=1e-4)  # the same steps, re-run
    evals = [json.loads(line)["step"] for line in (out / "eval.jsonl").read_text().splitlines()]
    assert evals == [
        2,
        4,
    ]  # the eval at step 4 re-ran and replaced its row; step 2's (before the checkpoint) kept
    shown = [json.loads(line)["step"] for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert shown == [2, 2, 4, 4]
    scored = [json.loads(line)["step"] for line in (out / "eval_predictions.jsonl").read_text().splitlines()]
    assert scored == [2, 4]  # the predictions sidecar replaced the same way
    after_resume = hashes(out)

    # start again: the old run moves aside whole, said in one line
    third = run_cli("train-ab", str(config), "--overwrite", "--set", "training.max_steps=2")
    assert third.returncode == 0, third.stderr[-3000:]
    (aside,) = tmp_path.glob("run.replaced-*")
    assert (
        f"--overwrite: moved the previous run in {out} (4 metrics rows, checkpoint-2, checkpoint-4, finished)"
        in (third.stderr)
    )
    assert hashes(aside) == after_resume
    assert [r["step"] for r in read_metrics(out)] == [0, 1]
    # --overwrite acted on that start only: the run's config.yaml, reused to resume, does not move it aside
    assert yaml.safe_load((out / "config.yaml").read_text())["training"]["overwrite_output_dir"] is False
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint-2",
        "config.yaml",
        "eval.jsonl",
        "eval_gt.coco.json",
        "eval_predictions.jsonl",
        "eval_samples.jsonl",
        "final_state.json",
        "metrics.jsonl",
        "plan.json",
        "samples.jsonl",
    ]
    assert read_train_plan(out / "plan.json").training.max_steps == 2  # what the ranks ran, --set included
