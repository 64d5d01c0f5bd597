"""`stagectl train-ab` end to end: the real CLI in a subprocess, the tiny Qwen2.5-VL, CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stagectl.learner.samples import read_samples
from stagectl.schedule import channel_for_step
from tests.integration.helpers import (
    check_phase_times,
    read_metrics,
    run_cli,
    tiny_train_config,
    write_config,
)


@pytest.fixture(scope="module")
def gas4_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict]]:
    """Step mode, GAS=4, b_ratio 0.5, 8 rollouts per B step in generate calls of 2, checkpoint every 2."""
    tmp = tmp_path_factory.mktemp("gas4")
    cfg = tiny_train_config(
        tmp,
        training={
            "gradient_accumulation_steps": 4,
            "per_device_train_batch_size": 1,
            "max_steps": 4,
            "save_steps": 2,
        },
        stage2_ab={"channel_b": {"rollouts_per_step": 8, "rollout_decode_batch_size": 2}},
    )
    config = write_config(tmp / "cfg.yaml", cfg)
    result = run_cli("train-ab", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    return config, tmp / "run", read_metrics(tmp / "run")


def test_one_row_per_step_and_kind_follows_schedule(gas4_run: tuple) -> None:
    _, _, rows = gas4_run
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["kind"] for r in rows] == [channel_for_step(s, 0.5) for s in range(4)] == ["A", "B", "A", "B"]
    for r in rows:
        for key in ("lr", "loss", "loss/ce", "loss/bbox_smoothl1", "loss/bbox_ciou", "tokens", "time/step_s"):
            assert key in r
        assert r["packing/n_packs"] >= r["packing/lower_bound"] >= 1


def test_exactly_one_optimizer_update_per_step(gas4_run: tuple) -> None:
    _, run_dir, rows = gas4_run
    check_phase_times(rows)
    assert [r["optimizer_updates"] for r in rows] == [1, 2, 3, 4]
    state = json.loads((run_dir / "final_state.json").read_text())
    assert state["num_updates"] == 4 and state["global_step"] == 4


def test_b_loop_runs_once_on_last_micro_step(gas4_run: tuple) -> None:
    _, _, rows = gas4_run
    b_rows = [r for r in rows if r["kind"] == "B"]
    assert b_rows
    for r in b_rows:
        assert r["rollout/n_samples"] == 8
        assert r["rollout/num_generate_calls"] == 4  # 8 rollouts, 2 per generate call
        for key in (
            "rollout/precision",
            "rollout/recall",
            "rollout/f1",
            "rollout/n_valid",
            "rollout/n_dropped",
        ):
            assert key in r
        assert "rollout/parse_truncated_rate" in r and r["time/rollout_s"] > 0
        # step mode: the learner itself waits for the rollouts and builds the packs
        assert r["time/wait_packs_s"] > 0 and r["time/collate_s"] > 0
    a_rows = [r for r in rows if r["kind"] == "A"]
    assert all("rollout/f1" not in r for r in a_rows)
    assert all(r["num_backward"] == 4 for r in a_rows)  # one packed sequence per micro-step
    for r in a_rows:  # each one filled from the look-ahead buffer toward global_max_length (512)
        assert r["packing/n_packs"] == 4 and r["packing/n_segments"] >= 8
        assert r["packing/fill"] >= 0.9 and r["packing/fill_min"] >= 0.85
        assert r["packing/tokens_per_forward"] == r["tokens"] / 4


def test_rollouts_pack_into_fewer_packs(gas4_run: tuple) -> None:
    _, _, rows = gas4_run
    for r in (r for r in rows if r["kind"] == "B"):
        assert r["packing/n_segments"] == 8
        assert r["packing/n_packs"] < 8
        assert r["num_backward"] == r["packing/n_packs"]  # one forward/backward per pack


def test_checkpoint_is_loadable_hf_format(gas4_run: tuple) -> None:
    _, run_dir, _ = gas4_run
    from transformers import AutoConfig

    for step in (2, 4):
        ckpt = run_dir / f"checkpoint-{step}"
        assert (ckpt / "model" / "model.safetensors").is_file()
        assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == step
        assert AutoConfig.from_pretrained(ckpt / "model").model_type == "qwen2_5_vl"
    assert not list(run_dir.glob(".tmp-checkpoint-*"))
    assert (run_dir / "config.yaml").is_file()


def test_resume_reproduces_the_uninterrupted_run(gas4_run: tuple, tmp_path: Path) -> None:
    config, run_dir, rows = gas4_run
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(run_dir / "checkpoint-2", resumed_dir / "checkpoint-2")
    result = run_cli(
        "train-ab",
        str(config),
        "--set",
        f"training.output_dir={resumed_dir}",
        "--set",
        "training.resume_from_checkpoint=latest",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = read_metrics(resumed_dir)
    assert [r["step"] for r in resumed] == [2, 3]
    assert [r["kind"] for r in resumed] == [r["kind"] for r in rows[2:]]
    assert resumed[-1]["optimizer_updates"] == rows[-1]["optimizer_updates"] == 4
    for got, want in zip(resumed, rows[2:], strict=True):
        # the same packs (the look-ahead buffer was restored) and so the same losses
        assert got["packing/n_segments"] == want["packing/n_segments"] and got["tokens"] == want["tokens"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got.get("rollout/seed") == want.get("rollout/seed")
    # the same samples from the same stream positions, line for line (A's look-ahead buffer included)
    whole = [s for s in read_samples(run_dir / "samples.jsonl") if s["step"] >= 2]
    assert read_samples(resumed_dir / "samples.jsonl") == whole


def test_samples_jsonl_lists_every_trained_segment(gas4_run: tuple) -> None:
    """One line per trained segment, on its step and channel, B lines with the weights' version."""
    _, run_dir, rows = gas4_run
    samples = read_samples(run_dir / "samples.jsonl")
    for row in rows:
        mine = [s for s in samples if s["step"] == row["step"]]
        assert len(mine) == row["packing/n_segments"] and {s["channel"] for s in mine} == {row["kind"]}
        if row["kind"] == "B":
            assert all(s["gen_version"] == s["train_version"] == row["optimizer_updates"] - 1 for s in mine)
    for channel in ("A", "B"):  # a stream position is never trained twice
        positions = [s["stream_pos"] for s in samples if s["channel"] == channel]
        assert len(positions) == len(set(positions))


# The 2-rank A-only run (identical weights on both ranks, the attention named, `--nproc 2` relaunching
# under torchrun, one packed sequence per rank) is asserted on the one 2-rank A-only run of this tier:
# test_placement.py::test_torchrun_ranks_get_their_cpu_slices_and_the_learner_devices.


def test_step_mode_with_two_ranks_fails_before_launch(tmp_path: Path) -> None:
    cfg = tiny_train_config(tmp_path)
    result = run_cli("train-ab", str(write_config(tmp_path / "cfg.yaml", cfg)), "--nproc", "2")
    assert result.returncode == 1
    assert "stage2_ab.channel_b.mode: async" in result.stderr
    assert "launching:" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_bad_data_line_one_line_error(tmp_path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (112, 112)).save(tmp_path / "a.png")
    lines = [
        {
            "images": ["a.png"],
            "width": 112,
            "height": 112,
            "objects": [{"desc": "red circle", "bbox_2d": [1, 2, 3, 4]}],
        },
        {
            "images": ["a.png"],
            "width": 112,
            "height": 112,
            "objects": [{"desc": "red circle", "bbox_2d": [5, 6, 7]}],
        },
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = tiny_train_config(tmp_path, data={"train_jsonl": str(data)})
    cfg["data"].pop("synthetic")
    config = str(write_config(tmp_path / "cfg.yaml", cfg))
    result = run_cli("train-ab", config)
    assert result.returncode == 1
    assert f"{data}:2:" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    # the data is checked before anything is done to the run directory: --overwrite moves nothing aside
    old_run = tmp_path / "run"
    old_run.mkdir()
    (old_run / "metrics.jsonl").write_text('{"step": 0, "kind": "A"}\n')  # a run --overwrite would move aside
    result = run_cli("train-ab", config, "--overwrite")
    assert result.returncode == 1 and f"{data}:2:" in result.stderr
    assert (old_run / "metrics.jsonl").exists() and not list(tmp_path.glob("run.replaced-*"))


def test_missing_image_one_line_error(tmp_path: Path) -> None:
    line = {"images": ["nope.png"], "width": 112, "height": 112, "objects": []}
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(line) + "\n")
    cfg = tiny_train_config(tmp_path, data={"train_jsonl": str(data)})
    cfg["data"].pop("synthetic")
    result = run_cli("train-ab", str(write_config(tmp_path / "cfg.yaml", cfg)))
    assert result.returncode == 1
    assert f"{data}:1:" in result.stderr and "nope.png" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_missing_model_dir_one_line_error(tmp_path: Path) -> None:
    cfg = tiny_train_config(tmp_path, model={"name_or_path": str(tmp_path / "no_such_model")})
    result = run_cli("train-ab", str(write_config(tmp_path / "cfg.yaml", cfg)))
    assert result.returncode == 1
    assert "model.name_or_path" in result.stderr and "no_such_model" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # a failed start leaves no empty run directory behind


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.integration.helpers import ROOT

    cfg = tiny_train_config(tmp_path, training={"max_steps": 200}, stage2_ab={"schedule": {"b_ratio": 0.0}})
    config = write_config(tmp_path / "cfg.yaml", cfg)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stagectl", "train-ab", str(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "no metrics row in time"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]  # not 0: `train-ab && next` stops here
    assert "stopped by SIGTERM after step" in stderr
    # the end line says how, with the run's own config.yaml (it holds every --set and --nproc)
    assert f"Continue with: stagectl train-ab {tmp_path / 'run' / 'config.yaml'} --resume" in stderr
    rows = read_metrics(tmp_path / "run")
    assert 1 <= len(rows) < 200
    state = json.loads((tmp_path / "run" / f"checkpoint-{len(rows)}" / "trainer_state.json").read_text())
    assert state["global_step"] == len(rows)


def test_held_out_eval_rows(tmp_path: Path) -> None:
    from stagectl.data.synthetic import generate_synthetic

    cfg = tiny_train_config(
        tmp_path,
        stage2_ab={"schedule": {"b_ratio": 0.0}},
        data={"eval": {"synthetic": {"num_samples": 3, "seed": 5, "max_objects": 2}, "every_steps": 1}},
    )
    result = run_cli("train-ab", str(write_config(tmp_path / "cfg.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval step 2: AP=" in result.stderr and " f1=" in result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    metric_rows = read_metrics(tmp_path / "run")  # the same numbers next to the training metrics
    assert [m["eval/AP"] for m in metric_rows] == [r["AP"] for r in rows]
    assert [m["eval/f1"] for m in metric_rows] == [r["f1"] for r in rows]
    held_out = generate_synthetic(3, 5, image_size=112, max_objects=2, split="eval")
    for r in rows:
        assert r["n_samples"] == 3 and r["n_gt"] == sum(len(s.objects) for s in held_out)
        assert 0 <= r["f1"] <= 1 and 0 <= r["valid_json_rate"] <= 1
        assert all(0 <= r[k] <= 1 for k in ("AP", "AP50", "AP75", "AR100"))
        assert set(r["per_class_ap"]) <= {o.desc for s in held_out for o in s.objects}
        assert r["n_matched"] <= min(r["n_pred"], r["n_gt"])
    # the scored predictions and the evaluated images, for AP intervals: re-scoring them gives the row's AP
    from stagectl.evaluation.coco import coco_summary

    gt = json.loads((tmp_path / "run" / "eval_gt.coco.json").read_text())
    scored = [
        json.loads(line) for line in (tmp_path / "run" / "eval_predictions.jsonl").read_text().splitlines()
    ]
    assert [p["step"] for p in scored] == [r["step"] for r in rows]
    assert len(gt["images"]) == 3
    for r, p in zip(rows, scored, strict=True):
        assert len(p["predictions"]) <= r["n_pred"]
        assert coco_summary(gt, p["predictions"])["AP"] == pytest.approx(r["AP"], abs=1e-9)
    shown = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["index"]) for s in shown] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    for s in shown:
        gt = held_out[s["index"]].objects
        assert s["gt"] == [{"desc": o.desc, "bbox_2d": list(o.bbox_2d)} for o in gt]
        assert isinstance(s["rollout"], str)
        assert all(set(p) == {"desc", "bbox_2d", "score"} and len(p["bbox_2d"]) == 4 for p in s["parsed"])
        assert all(0 < p["score"] <= 1 for p in s["parsed"])
