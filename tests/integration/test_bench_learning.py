"""`python -m bench learning --quick`: the learning check's own code (Stage-1 -> checkpoint -> the screen of
A-only and two Channel-B variants, eval with predictions, AP and label intervals, the tables BENCHMARKS.md
shows) on a few steps. Plumbing only: no learning is expected in 2 steps."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from bench.bench_learning import QUICK_VARIANTS, SCREEN_B_RATIO, run, run_name
from bench.markdown_learning import learning_section


def test_quick_learning_check_screens_the_variants_from_the_stage1_checkpoint(tmp_path: Path) -> None:
    result = run(quick=True, out_dir=tmp_path)

    assert list(result["tasks"]) == ["sparse"]
    task = result["tasks"]["sparse"]
    assert task["step"] == result["sizes"]["phase2_steps"]
    assert sorted(row["variant"] for row in task["screen"]) == sorted(QUICK_VARIANTS)
    assert result["selection"]["best_two"] and set(result["selection"]["best_two"]) <= set(QUICK_VARIANTS)
    for row in task["screen"]:
        m = row["metrics"]
        # box vs label, each with its interval, and the paired difference to A-only
        for key in (
            "AP",
            "AP_agnostic",
            "desc_accuracy",
            "f1",
            "f1_desc",
            "d_AP",
            "d_AP_agnostic",
            "d_f1_desc",
        ):
            assert m[key]["low"] <= m[key]["value"] <= m[key]["high"], (row["variant"], key)
        assert row["wall"]["d_AP"] is not None and row["a_only_steps"]
    stage1 = task["stage1"]["metrics"]
    assert 0 <= stage1["AP"]["value"] <= 1 and "d_AP" not in stage1
    assert task["protocol"][0]["variant"] == "A-only" and "d_AP" in task["protocol"][0]["metrics"]
    assert task["confirm"][0]["variant"] == "A-only"  # one seed: no group to confirm

    checkpoint = tmp_path / "sparse-stage1" / "checkpoint-2" / "model"
    targets = {"raw_prefix": "raw_prefix", "reordered_gt desc_matched": "reordered_gt"}
    for variant in QUICK_VARIANTS:
        run_dir = tmp_path / run_name("sparse", variant, SCREEN_B_RATIO, 0)
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert config["model"]["name_or_path"] == str(checkpoint)  # phase 2 starts from Stage-1
        assert config["stage2_ab"]["channel_b"]["target"] == targets[variant]
        assert config["stage2_ab"]["schedule"]["b_ratio"] == SCREEN_B_RATIO
        assert config["training"]["learning_rate"] == result["sizes"]["phase2_lr"]
        scored = (run_dir / "eval_predictions.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in scored] == [1, 2]
        last_eval = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[-1])
        assert len(last_eval["per_image"]) == result["sizes"]["eval_images"]["sparse"]
    a_only = yaml.safe_load((tmp_path / "sparse-A-only-seed0" / "config.yaml").read_text())
    assert a_only["training"]["max_steps"] == result["a_only_factor"] * result["sizes"]["phase2_steps"]

    text = "\n".join(learning_section(result))
    assert "### sparse task" in text and "**Screen**" in text and "Goal, AB above A-only" in text
