"""`python -m bench learning --quick`: the learning check's own code (Stage-1 -> checkpoint -> A-only / AB
raw / AB clean, eval, intervals, equal-step and equal-wall tables, plot) on a few steps. Plumbing only:
no learning is expected in 2 steps."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from bench.bench_learning import run


def test_quick_learning_check_runs_every_variant_from_the_stage1_checkpoint(tmp_path: Path) -> None:
    result = run(quick=True, out_dir=tmp_path)

    assert list(result["tasks"]) == ["sparse"]
    task = result["tasks"]["sparse"]
    assert task["step"] == result["sizes"]["phase2_steps"]
    rows = task["table"][2:]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == [
        "A-only",
        "AB b=0.5 clean_prefix",
        "AB b=0.5 raw_prefix",
    ]
    # every metric has an interval, and AB rows also ΔF1 against A-only
    assert [r.count("[") for r in rows] == [5, 6, 6]
    assert set(task["equal_wall"]) == {"AB b=0.5 clean_prefix", "AB b=0.5 raw_prefix"}
    # COCO AP next to F1: per variant at the equal step, and the Stage-1 checkpoint's
    assert set(task["ap_at_equal_steps"]) == {"A-only", "AB b=0.5 clean_prefix", "AB b=0.5 raw_prefix"}
    assert all(0 <= v["min"] <= v["mean"] <= v["max"] <= 1 for v in task["ap_at_equal_steps"].values())
    assert 0 <= task["stage1"]["AP"] <= 1
    assert Path(task["plot"]).is_file() and Path(task["plot"]).is_relative_to(tmp_path)

    checkpoint = tmp_path / "sparse-stage1" / "checkpoint-2" / "model"
    for variant, target in (("AB_raw_prefix", "raw_prefix"), ("AB_clean_prefix", "clean_prefix")):
        run_dir = tmp_path / f"sparse-{variant}-seed0"
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert config["model"]["name_or_path"] == str(checkpoint)  # phase 2 starts from Stage-1
        assert config["stage2_ab"]["channel_b"]["target"] == target
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        b_rows = [m for m in metrics if m["kind"] == "B"]
        assert b_rows and all("rollout/dup_total" in m and "rollout/dup_rate" in m for m in b_rows)
        last_eval = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[-1])
        assert len(last_eval["per_image"]) == result["sizes"]["eval_images"]["sparse"]
    a_only = yaml.safe_load((tmp_path / "sparse-A-only-seed0" / "config.yaml").read_text())
    assert a_only["training"]["max_steps"] == result["a_only_factor"] * result["sizes"]["phase2_steps"]
