"""The learning check's separated reading (`bench.markdown_learning.reading`) on made-up numbers: the
per-step comparison only where A-only gained, and which side an uneven equal-wall read favours."""

from __future__ import annotations

from typing import Any

from bench.markdown_learning import A2, AB, reading


def task(*, a_only_f1: float, a_read_s: list[float], ab_s: float = 40.0) -> dict[str, Any]:
    return {
        "step": 200,
        "train_s": {AB: ab_s, A2: 20.0},
        "f1": {
            "start": 0.90,
            AB: 0.93,
            A2: a_only_f1,
            "delta_equal_steps": {"value": 0.03, "low": 0.01, "high": 0.05},
            "a_only_end_step": 400,
            "a_only_end": 0.95,
        },
        "equal_wall": {
            "ab_train_s": ab_s,
            "a_only_steps": [400],
            "a_only_train_s": a_read_s,
            "delta_f1": {"value": 0.0, "low": -0.02, "high": 0.02},
        },
        "overlap": {
            "train_s": ab_s,
            "wait_packs_s": 0.0,
            "fence_s": 10.0,
            "weight_sync_s": 2.0,
            "idle_fraction": 0.25,
            "ver_lag_mean": 1.0,
            "drop_rate": 0.0,
            "b_ratio_realized": 0.5,
        },
    }


def test_per_step_ratio_only_where_a_only_gained() -> None:
    # A-only +0.01 over 200 steps, AB +0.03: AB needs 2x (its wall ratio), it had 3x
    gained = " ".join(reading("sparse", task(a_only_f1=0.91, a_read_s=[38.0, 39.0])))
    assert "AB needs 2.00x A-only's gain per step, it had 3.00x." in gained
    # A-only lost F1 from the checkpoint: no ratio of a negative gain is printed
    lost = " ".join(reading("sparse", task(a_only_f1=0.89, a_read_s=[38.0, 39.0])))
    assert "A-only did not gain from the checkpoint, so no per-step ratio applies." in lost
    assert "AB needs" not in lost


def test_an_uneven_equal_wall_read_says_whom_it_favours() -> None:
    # A-only's read at step 400 trained longer than AB (40 s): in A-only's favour
    longer = " ".join(reading("sparse", task(a_only_f1=0.91, a_read_s=[44.0, 46.0])))
    assert (
        "A-only's read (step 400, 44-46 s) had more training seconds than AB's 40 s (in A-only's favour)."
        in longer
    )
    # within AB's time: nothing to say
    shorter = " ".join(reading("sparse", task(a_only_f1=0.91, a_read_s=[38.0, 41.0])))
    assert "favour" not in shorter
    # AB's time runs past A-only's last eval (ratio 2.5 x 200 > 400): in AB's favour
    past = " ".join(reading("sparse", task(a_only_f1=0.91, a_read_s=[38.0, 39.0], ab_s=50.0)))
    assert "in AB's favour" in past
