"""The learning check's analysis and its generated reading on made-up rows: run names parse back to their
variant, b_ratio and seed; the reading says "above 0" only when a whole interval is, and names the goal as
met only then."""

from __future__ import annotations

from typing import Any

from bench.bench_learning import AB_VARIANTS, run_name
from bench.learning_analysis import overall_reading, parse_name
from bench.markdown_learning import sign, table


def test_run_names_parse_back() -> None:
    for variant in AB_VARIANTS:
        assert parse_name("sparse", run_name("sparse", variant, 0.05, 2)) == (variant, 0.05, 2)
    assert parse_name("dense", run_name("dense", "A-only", 0, 1)) == ("A-only", 0.0, 1)
    assert parse_name("sparse", "sparse-A-only_lr0.0003-seed0") == ("A-only_lr0.0003", 0.0, 0)
    assert parse_name("sparse", "dense-A-only-seed0") is None
    assert parse_name("sparse", "sparse-stage1") is None


def iv(value: float, half: float) -> dict[str, float]:
    return {"value": value, "low": value - half, "high": value + half}


def task(d_wall: float, d_stage1: float, a_vs_stage1: float) -> dict[str, Any]:
    wall = {k: iv(d_wall, 0.01) for k in ("d_AP", "d_AP_agnostic", "d_desc_accuracy", "d_f1_desc")}
    return {
        "confirm": [
            {"variant": "A-only", "b_ratio": 0, "seeds": 3, "metrics": {"d_AP": iv(a_vs_stage1, 0.005)}},
            {
                "variant": "reordered_gt desc_matched",
                "b_ratio": 0.1,
                "seeds": 3,
                "metrics": {"d_AP": iv(d_wall, 0.01)},
                "wall": wall,
                "vs_stage1": {"d_AP": iv(d_stage1, 0.01)},
            },
        ]
    }


def test_reading_says_met_only_when_the_interval_is_above_zero() -> None:
    won = overall_reading({"sparse": task(0.03, 0.02, -0.01), "dense": task(0.005, 0.0, 0.0)})
    assert won[-2].endswith("met (sparse).") and won[-1].endswith("met (sparse).")
    assert (
        "reordered_gt desc_matched at b_ratio 0.1: class-aware ΔAP vs A-only +0.030 [+0.020, +0.040]"
        in won[0]
    )
    lost = overall_reading({"sparse": task(0.005, 0.005, -0.02)})
    assert lost[-2].endswith("not met on any task.") and lost[-1].endswith("not met on any task.")
    assert sign(iv(-0.03, 0.01)) == "below 0" and sign(iv(0.0, 0.01)) == "not distinguishable from 0"


def test_table_rows_carry_every_interval() -> None:
    metrics = {k: iv(0.5, 0.02) for k in ("AP", "AP_agnostic", "desc_accuracy", "f1", "f1_desc")}
    metrics.update({k: iv(0.01, 0.02) for k in ("d_AP", "d_AP_agnostic", "d_desc_accuracy", "d_f1_desc")})
    lines = table([{"variant": "x", "b_ratio": 0.25, "seeds": 3, "metrics": metrics, "train_s": 61.4}])
    assert lines[0].startswith("| variant | b_ratio | seeds | AP | ΔAP |")
    assert lines[2] == (
        "| x | 0.25 | 3 | 0.500 [0.480, 0.520] | +0.010 [-0.010, +0.030] | 0.500 [0.480, 0.520] | "
        "+0.010 [-0.010, +0.030] | 0.500 [0.480, 0.520] | +0.010 [-0.010, +0.030] | 0.500 [0.480, 0.520] | "
        "0.500 [0.480, 0.520] | +0.010 [-0.010, +0.030] | 61 |"
    )
    assert table([{"variant": "y", "b_ratio": 0, "seeds": 1, "metrics": {"AP": iv(0.2, 0.01)}}])[2].endswith(
        "| — |"
    )
