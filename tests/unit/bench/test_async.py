"""`python -m bench async`'s arithmetic on made-up metrics rows: idle, overlap, the async / step ratio and
step mode's overlap bound, and the section it renders."""

from __future__ import annotations

from typing import Any

import pytest

from bench import bench_async
from bench.bench_async import compare, merge, summarise
from bench.markdown_async import _spread, async_section


def step_row(step: int, *, step_s: float, rollout_s: float, tokens: int) -> dict[str, Any]:
    return {
        "step": step,
        "kind": "B" if step % 2 else "A",
        "tokens": tokens,
        "time/step_s": step_s,
        "time/rollout_s": rollout_s,
        "time/wait_packs_s": rollout_s,
        "time/forward_backward_s": step_s - rollout_s - 0.1,
        "time/optimizer_s": 0.1,
        "time/weight_sync_s": 0.0,
    }


def async_row(step: int, *, busy_s: float, sync_s: float = 0.0) -> dict[str, Any]:
    key = "stage2_ab/async/"
    return {
        "step": step,
        "kind": "B" if step % 2 else "A",
        "tokens": 1000,
        "time/step_s": 1.0,
        "time/wait_packs_s": 0.05,
        "time/fence_s": 0.05,
        "time/forward_backward_s": 0.8,
        "time/weight_sync_s": sync_s,
        key + "prefetch_busy_s": busy_s,
        key + "rollouts_requested_total": 10 * step,
        key + "rollouts_dropped_total": step,
    }


def test_step_mode_bound_and_async_ratio() -> None:
    # step mode: every step 2 s, of which 1 s rollouts (R = T): perfect overlap would double the throughput
    step = summarise([step_row(s, step_s=2.0, rollout_s=1.0, tokens=1000) for s in range(8)], "step")
    assert step["steps"] == 5
    assert step["learner_idle_fraction"] == pytest.approx(0.5)
    assert step["overlap_ratio"] == pytest.approx(0.5)
    assert step["trained_tokens_per_s"] == pytest.approx(500.0)
    # async: 1 s per step, idle 0.1 s, the prefetcher busy 0.6 s per step
    rows = [async_row(s, busy_s=0.6 * s, sync_s=0.1 if s % 2 else 0.0) for s in range(8)]
    fast = summarise(rows, "async")
    assert fast["learner_idle_fraction"] == pytest.approx(0.1)
    assert fast["overlap_ratio"] == pytest.approx(0.9)  # max(R = 0.6, T = 0.9) / 1
    assert fast["idle_floor"] == 0.0  # learner-bound: the rollouts could keep up
    # rollout-bound: the prefetcher busy 1.2 s per 1 s step; T = 0.9 -> the learner waits >= 1 - 0.9 / 1.2
    bound_by_rollouts = summarise([async_row(s, busy_s=1.2 * s) for s in range(8)], "async")
    assert bound_by_rollouts["idle_floor"] == pytest.approx(0.25)
    assert fast["drop_rate"] == pytest.approx(0.1)
    assert fast["weight_sync_share"] == pytest.approx(0.04)  # 2 syncs of 0.1 s in 5 steps of 1 s
    ratios = compare({"b0.5/step/separated": step, "b0.5/async/separated": fast})
    assert ratios["b0.5/separated"] == pytest.approx(
        {"async_over_step": 2.0, "bound": 2.0, "of_bound": 1.0, "rollout_cost_async_over_step": None}
    )
    step["request_s_per_rollout"], fast["request_s_per_rollout"] = 0.04, 0.05  # server s per rollout
    assert compare({"b0.5/step/separated": step, "b0.5/async/separated": fast})["b0.5/separated"][
        "rollout_cost_async_over_step"
    ] == pytest.approx(1.25)
    ratios = compare({"b0.5/step/separated": step, "b0.5/async/separated": fast})
    text = "\n".join(async_section({"max_steps": 8, "loadavg": [9.0, 9.5], "runs": {
        "b0.5/step/separated": step, "b0.5/async/separated": fast}, "compare": ratios}))  # fmt: skip
    assert "| b0.5/separated | 2.00x | 2.00x | 1.00 | 1.25 |" in text
    assert "a loaded machine" in text and "a short check" in text
    # every run says how many of its measured steps trained Channel-B (fewer B steps would look faster)
    assert "| b0.5/async/separated | 2/5 | 1000 |" in text


def test_variant_compares_with_its_base_step_runs_and_save_merges(monkeypatch: pytest.MonkeyPatch) -> None:
    # an async-only variant (a key that does nothing in step mode) is compared with its base's step runs
    monkeypatch.setitem(bench_async.CONFIGS, "b1.0w2", ("async",))
    monkeypatch.setitem(
        bench_async.VARIANTS, "b1.0w2", ("b1.0", {"stage2_ab.channel_b.async.version_window": 2})
    )
    step = summarise([step_row(s, step_s=2.0, rollout_s=1.0, tokens=1000) for s in range(8)], "step")
    fast = summarise([async_row(s, busy_s=0.6 * s) for s in range(8)], "async")
    slow = summarise([{**async_row(s, busy_s=0.6 * s), "tokens": 500} for s in range(8)], "async")
    saved = {
        "max_steps": 18,
        "loadavg": [0.5, 0.6],
        "total_s": 100.0,
        "runs": {"b1.0/step/separated": step, "b1.0/async/separated": slow},
    }
    saved["compare"] = compare(saved["runs"])
    assert saved["compare"]["b1.0/separated"]["async_over_step"] == pytest.approx(1.0)
    new = {
        "max_steps": 12,
        "ran_at": "2026-11-26 04:10:00",
        "loadavg": [2.0, 2.5],
        "total_s": 30.0,
        "runs": {"b1.0w2/async/separated": fast},
    }
    merged = merge(saved, new)
    # the saved rows stay, the new one is added and compared with b1.0's step run
    assert set(merged["runs"]) == {"b1.0/step/separated", "b1.0/async/separated", "b1.0w2/async/separated"}
    assert merged["max_steps"] == 18 and merged["total_s"] == pytest.approx(130.0)
    assert merged["compare"]["b1.0/separated"]["async_over_step"] == pytest.approx(1.0)
    assert merged["compare"]["b1.0w2/separated"]["async_over_step"] == pytest.approx(2.0)
    assert merged["rerun"] == {"b1.0w2/async/separated": {"max_steps": 12, "loadavg": [2.0, 2.5],
                                                          "ran_at": "2026-11-26 04:10:00"}}  # fmt: skip
    text = "\n".join(async_section(merged))
    assert (
        "`b1.0w2/async/separated` re-run alone" in text
        and "12 steps, load 2.0-2.5 (**a short check**)" in text
    )
    # the variant's line names its base's step-mode rollout share, and judges the one run
    assert (
        "Target: rollout-heavy (b1.0w2; step mode waits 50% of its wall on rollouts; separated) async / step "
        ">= 1.6x with learner idle <= 10%: 2.00x, idle 0.100 in the table's run: met (one run)." in text
    )
    # a re-run of a saved row replaces it
    again = merge(merged, {**new, "runs": {"b1.0/async/separated": fast}})
    assert again["compare"]["b1.0/separated"]["async_over_step"] == pytest.approx(2.0)
    assert set(again["rerun"]) == {"b1.0w2/async/separated", "b1.0/async/separated"}
    assert merge(None, new) is new


def test_variant_with_its_own_step_runs_changes_the_base_config(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = bench_async._config(tmp_path, "b1.0n40", "step", 18, (0, 1))
    base = bench_async._config(tmp_path, "b1.0", "step", 18, (0, 1))
    assert cfg["custom"]["extra"]["rollout_matching"]["max_new_tokens"] == 40
    assert base["custom"]["extra"]["rollout_matching"]["max_new_tokens"] == 48
    cfg["custom"]["extra"]["rollout_matching"]["max_new_tokens"] = 48
    assert cfg == base  # nothing else differs
    # compared with its own step runs, not b1.0's
    step = summarise([step_row(s, step_s=2.0, rollout_s=1.0, tokens=1000) for s in range(8)], "step")
    slower_step = summarise([step_row(s, step_s=4.0, rollout_s=2.0, tokens=1000) for s in range(8)], "step")
    fast = summarise([async_row(s, busy_s=0.6 * s) for s in range(8)], "async")
    runs = {
        "b1.0/step/separated": step,
        "b1.0n40/step/separated": slower_step,
        "b1.0n40/async/separated": fast,
    }
    assert compare(runs)["b1.0n40/separated"]["async_over_step"] == pytest.approx(4.0)
    # a misspelt key fails instead of adding a key no config reads
    monkeypatch.setitem(
        bench_async.VARIANTS, "b1.0typo", ("b1.0", {"custom.extra.rollout_matching.max_new_token": 40})
    )
    with pytest.raises(KeyError, match=r"not in the b1\.0 config"):
        bench_async._config(tmp_path, "b1.0typo", "step", 18, None)


def test_repeats_render_as_a_spread_beside_the_targets() -> None:
    step = summarise([step_row(s, step_s=2.0, rollout_s=1.0, tokens=1000) for s in range(8)], "step")
    fast = summarise([async_row(s, busy_s=0.6 * s) for s in range(8)], "async")
    runs = {
        f"{c}/{m}/separated": (step if m == "step" else fast)
        for c in ("example", "b1.0")
        for m in ("step", "async")
    }
    row = {"async_over_step": 1.5, "bound": 2.0, "of_bound": 0.75, "rollout_cost_async_over_step": 1.2}
    spread = {
        "n": 3,
        "max_steps": 18,
        "loadavg": [0.5, 0.7],
        "ran_at": "2026-11-26 05:00:00",
        "runs": {
            "example": [{**row, "of_bound": f, "idle": 0.2} for f in (0.9, 0.8, 0.85)],
            "b1.0": [
                {**row, "async_over_step": r, "idle": i, "idle_floor": i - 0.02}
                for r, i in ((1.7, 0.12), (1.6, 0.08), (1.9, 0.1))
            ],
        },
    }
    text = "\n".join(
        async_section({"max_steps": 18, "runs": runs, "compare": compare(runs), "repeats": spread})
    )
    # repeats saved before the floor was recorded show none
    assert "| example | 1.50x/1.50x/1.50x | 0.80/0.85/0.90 | 0.200/0.200/0.200 | — | 1.20/1.20/1.20 |" in text
    assert (
        "| b1.0 | 1.60x/1.70x/1.90x | 0.75/0.75/0.75 | 0.080/0.100/0.120 | 0.060/0.080/0.100 | 1.20/1.20/1.20 |"
        in text
    )
    # every run judged, the table's and the repeats': 1.00 and 0.90 make it, 0.80 and 0.85 do not
    assert (
        "(separated): 1.000 in the table's run; 0.800/0.850/0.900 over the repeats: not met, 2 of 4 runs within it."
        in text
    )
    # (2.00x, 0.100) and (1.60x, 0.080) and (1.90x, 0.100) make it, (1.70x, 0.120) does not
    assert "idle 0.080/0.100/0.120 over the repeats: met, 3 of 4 runs within it." in text
    # a repeat that trained fewer B steps than the schedule wanted (step mode's 2 of 5) meets nothing
    spread["runs"]["b1.0"][1]["b_steps"] = 1
    fewer = "\n".join(
        async_section({"max_steps": 18, "runs": runs, "compare": compare(runs), "repeats": spread})
    )
    assert "idle 0.080/0.100/0.120 over the repeats: not met, 2 of 4 runs within it." in fewer
    spread["runs"]["example"][0]["b_steps"] = 1  # the 0.90 repeat, with a B step trained as A
    assert "0.800/0.850/0.900 over the repeats: not met, 1 of 4 runs within it." in "\n".join(
        async_section({"max_steps": 18, "runs": runs, "compare": compare(runs), "repeats": spread})
    )
    # the floors: 0 in the table's learner-bound run, 0.06-0.10 in the repeats; none above 10%
    assert (
        "`b1.0`: idle 0.100 over a floor of 0.070 (medians of 4 runs); the floor alone exceeds 10% in 0 of 4"
        in text
    )


def test_the_in_flight_sync_is_set_beside_the_fenced_one() -> None:
    """`example` (in-flight sync) and `example-fenced` (the variant: the sync waits for the burst in flight)
    against the same step runs, in the table and in every repeat, read as one line."""
    step = summarise([step_row(s, step_s=2.0, rollout_s=1.0, tokens=1000) for s in range(8)], "step")
    fast = summarise([async_row(s, busy_s=0.6 * s) for s in range(8)], "async")
    runs = {
        "example/step/separated": step,
        "example/async/separated": fast,
        "example-fenced/async/separated": {
            **fast,
            "trained_tokens_per_s": 800.0,
            "learner_idle_fraction": 0.15,
        },
    }
    compared = compare(runs)
    assert compared["example-fenced/separated"]["async_over_step"] == pytest.approx(1.6)  # 800 / step's 500
    row = {"bound": 2.0, "rollout_cost_async_over_step": 1.0}
    spread = {
        "n": 1,
        "max_steps": 18,
        "loadavg": [0.5, 0.5],
        "ran_at": "2026-11-26 12:00:00",
        "runs": {
            "example": [{**row, "async_over_step": 1.9, "of_bound": 0.95, "idle": 0.01}],
            "example-fenced": [{**row, "async_over_step": 1.7, "of_bound": 0.85, "idle": 0.12}],
        },
    }
    text = "\n".join(async_section({"max_steps": 18, "runs": runs, "compare": compared, "repeats": spread}))
    assert (
        "`example-fenced`: `example` with `stage2_ab.channel_b.async.in_flight_sync: False` "
        "(compared with `example`'s step runs)." in text
    )
    assert compared["example/separated"]["async_over_step"] == pytest.approx(2.0)
    assert (
        "In-flight weight sync (`example`) against the fenced one (`example-fenced`), separated, 2 side-by-side "
        "pair(s) (the table's and the repeats'), min/median/max: async / step "
        "1.90x/1.95x/2.00x against 1.60x/1.65x/1.70x, of the bound 0.95/0.97/1.00 against 0.80/0.82/0.85"
        in text
    )  # two pairs: the median is the mean of the two
    assert (
        f"learner idle 0.010/{(0.01 + fast['learner_idle_fraction']) / 2:.3f}/" in text
        and "against 0.120/0.135/0.150." in text
    )


def test_spread_median_of_an_even_count_is_the_mean_of_the_middle_two() -> None:
    """The fenced line sets the table's pair beside the repeats' (4 values with 3 repeats): its 'median' is
    the median, not the upper of the middle two (BENCHMARKS.md once showed 1.02 for a median of 1.006)."""
    assert _spread([9.0, 1.0, 4.0, 2.0], "{:.2f}") == "1.00/3.00/9.00"
    assert _spread([3.0, 1.0, 2.0], "{:.2f}") == "1.00/2.00/3.00"


def test_quietness_is_judged_outside_the_learners_waits() -> None:
    """A step-mode learner waits on rollouts by design, so its CPU share of the wall says little; its share
    of the time outside its waits shows whether other work took its pinned core."""

    def section(*runs: tuple[float, float]) -> str:
        named = {
            f"{config}/{mode}/separated": {"learner_thread_cpu_share": cpu, "learner_idle_fraction": idle}
            for (config, mode), (cpu, idle) in zip((("b1.0", "step"), ("b1.0", "async")), runs, strict=True)
        }
        return "\n".join(async_section({"max_steps": 18, "runs": named, "compare": {}}))

    quiet = section((0.6, 0.4), (0.9, 0.0))  # 0.6 of the wall, all of the time it was not waiting
    assert "0.60-0.90 of the wall in the separated runs, 0.90-1.00 of the time outside its waits" in quiet
    assert "the pinned cores were the runs' own." in quiet
    # a learner thread with 0.3 of the wall while waiting 10% of it: something else ran on its core
    shared = section((0.3, 0.1), (0.85, 0.0))
    assert "0.33-0.85 of the time outside its waits" in shared
    assert "other work shared the pinned cores" in shared and "runs' own" not in shared
