"""The W&B sink of train-ab's metrics on resume, against a stand-in `wandb` module (no service, no network)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stagectl.config.training import TrainingConfig
from stagectl.learner.metrics import METRICS_FILE, WANDB_RUN_ID_FILE, WandbSink


def _start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, resume_step: int) -> dict[str, Any]:
    inits: dict[str, Any] = {}
    fake = SimpleNamespace(init=lambda **kw: inits.update(kw) or SimpleNamespace(log=None, finish=None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    t = TrainingConfig(output_dir=tmp_path, report_to=["wandb"])
    WandbSink.start(t, {}, resume_step=resume_step)
    return inits


def test_a_resume_continues_the_w_and_b_run_and_says_which_steps_it_keeps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A W&B run's steps only go forward: the steps a resume retrains (after its checkpoint, logged by the
    interrupted process) keep their first values there. The resume said nothing; it names them now."""
    first = _start(monkeypatch, tmp_path, resume_step=0)
    rows = [json.dumps({"step": s, "loss": 1.0}) for s in range(7)] + ['{"step": 7, "lo']  # a torn last line
    (tmp_path / METRICS_FILE).write_text("\n".join(rows))
    resumed = _start(monkeypatch, tmp_path, resume_step=4)
    assert resumed["id"] == first["id"] == (tmp_path / WANDB_RUN_ID_FILE).read_text().strip()
    err = capsys.readouterr().err
    assert f"warning: W&B run {first['id']} keeps steps 4-6" in err
    _start(monkeypatch, tmp_path, resume_step=7)  # nothing logged past the checkpoint: nothing to say
    assert "keeps steps" not in capsys.readouterr().err
