"""`training.report_to: [wandb]` in offline mode (no network): the run, its name, its config and every
metrics row are written under `{output_dir}/wandb/`, read back here from W&B's own run file; a resumed
run continues the same W&B run."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stagectl.config import load_config, to_plain
from stagectl.learner.metrics import METRICS_FILE, WANDB_RUN_ID_FILE, MetricsWriter

pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2

pytestmark = pytest.mark.integration

BLOCK = 32768  # W&B's run file is a LevelDB-style log: 32 KiB blocks of (crc32, length, type) records
HEADER = 7
ROWS = [
    {"step": 0, "kind": "A", "loss": 2.5, "lr": 1e-4, "rollout/f1": None},
    {"step": 1, "kind": "B", "loss": 2.25, "lr": 1e-4, "rollout/f1": 0.5},
    {"step": 2, "kind": "A", "loss": float("nan"), "lr": 5e-5, "packing/fill": 0.75},
]


def read_run_records(path: Path) -> Iterator[Any]:
    """Every protobuf `Record` of a `.wandb` run file, in order."""
    data = path.read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        if pos + HEADER + length > len(data):  # still being written
            return
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full / first, middle / last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def run_files(output_dir: Path) -> list[Path]:
    """The `.wandb` file of every offline session written under `output_dir`, oldest first."""
    return sorted((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def offline_run(run_file: Path, timeout_s: float = 30.0) -> tuple[Any, list[dict[str, Any]]]:
    """(the run record, the history rows keyed as logged) of one offline session, once W&B's service
    process has written it to the end (its `exit` record; `finish()` may return a moment earlier)."""
    deadline = time.monotonic() + timeout_s
    records = list(read_run_records(run_file))
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, f"{run_file} was not completed"
        time.sleep(0.1)
        records = list(read_run_records(run_file))
    run, history = None, []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            items = record.history.item
            history.append(
                {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items}
            )
    assert run is not None
    return run, history


def _config(tmp_path: Path, run_name: str | None = None) -> Any:
    wandb = {"mode": "offline", "project": "stagectl-tests"} | ({"run_name": run_name} if run_name else {})
    sets = [
        f"training.output_dir={tmp_path / 'run'}",
        "training.report_to=[wandb]",
        f"training.wandb={json.dumps(wandb)}",
        "training.max_steps=3",
    ]
    return load_config(None, sets)


def test_offline_wandb_run_has_the_name_config_and_every_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _config(tmp_path)
    writer = MetricsWriter.for_training(cfg.training, to_plain(cfg))
    for row in ROWS:
        writer.write(row)
    writer.close()
    out = cfg.training.output_dir
    assert len((out / METRICS_FILE).read_text().splitlines()) == 3  # the JSONL sink is unchanged
    (run_file,) = run_files(out)
    run, history = offline_run(run_file)
    assert run.display_name == "run" and run.project == "stagectl-tests"  # default name: output_dir's
    assert run.run_id == (out / WANDB_RUN_ID_FILE).read_text().strip()
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["training"]["report_to"] == ["wandb"] and config["training"]["max_steps"] == 3
    assert config["model"]["name_or_path"] == cfg.model.name_or_path
    assert [h["_step"] for h in history] == [0, 1, 2]
    for logged, row in zip(history, ROWS, strict=True):
        expected = {k: v for k, v in row.items() if k != "step" and v is not None and v == v}  # no NaN/None
        assert {k: logged[k] for k in expected} == expected
    assert "rollout/f1" not in history[0] and "loss" not in history[2]  # nulls (NaN -> null) are left out


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _config(tmp_path, run_name="shapes")
    first = MetricsWriter.for_training(cfg.training, to_plain(cfg))
    first.write(ROWS[0])
    first.close()
    run_id = (cfg.training.output_dir / WANDB_RUN_ID_FILE).read_text().strip()
    resumed = MetricsWriter.for_training(cfg.training, to_plain(cfg), resume_step=1)
    resumed.write(ROWS[1])
    resumed.close()
    sessions = [offline_run(path) for path in run_files(cfg.training.output_dir)]
    assert [run.run_id for run, _ in sessions] == [run_id, run_id]  # one W&B run, two sessions
    assert [[h["_step"] for h in history] for _, history in sessions] == [[0], [1]]
    assert {run.display_name for run, _ in sessions} == {"shapes"}
    (cfg.training.output_dir / METRICS_FILE).unlink()  # what --overwrite does: the old rows are gone
    fresh = MetricsWriter.for_training(
        cfg.training, to_plain(cfg)
    )  # a fresh start (resume_step 0) is a new W&B run
    fresh.close()
    assert (cfg.training.output_dir / WANDB_RUN_ID_FILE).read_text().strip() != run_id


def test_report_to_rejects_unknown_sinks() -> None:
    from stagectl.config import ConfigError

    with pytest.raises(ConfigError, match="report_to"):
        load_config(None, ["training.report_to=[mlflow]"])


def test_train_ab_logs_every_step_to_an_offline_wandb_run(tmp_path: Path) -> None:
    """The real CLI: `report_to: [wandb]` in a train-ab run logs each optimizer step's row."""
    from tests.integration.helpers import read_metrics, run_cli, tiny_train_config, write_config

    cfg = tiny_train_config(
        tmp_path,
        stage2_ab={"schedule": {"b_ratio": 0.0}},
        training={"max_steps": 2, "report_to": ["wandb"], "wandb": {"mode": "offline", "project": "t"}},
    )
    result = run_cli("train-ab", str(write_config(tmp_path / "cfg.yaml", cfg)), env={"WANDB_SILENT": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    (run_file,) = run_files(tmp_path / "run")
    run, history = offline_run(run_file)
    assert run.project == "t" and [h["_step"] for h in history] == [0, 1]
    assert [h["loss"] for h in history] == pytest.approx([r["loss"] for r in rows])
