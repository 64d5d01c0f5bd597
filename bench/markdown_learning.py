"""BENCHMARKS.md: the learning check's separated sub-section (async AB, learner and rollout server on
separate cores, vs A-only on both cores), its reading generated from the numbers."""

from __future__ import annotations

from typing import Any

AB = "AB async separated"
A2 = "A-only 2 cores"


def _ci(d: dict[str, float] | None) -> str:
    if d is None:
        return "n/a"
    return f"{d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"


def reading(task: str, t: dict[str, Any]) -> list[str]:
    """What the numbers say, and what it would take for AB to win at equal wall time on this task.

    With a constant LR, A-only given AB's training time runs `ratio` x the steps (ratio = AB's seconds per
    step / A-only's); on A-only's own slope past step N (its F1 gain per step from N to its last eval),
    that is worth (ratio - 1) x N x slope of F1, which AB's lead at equal steps must exceed. Per step from
    the checkpoint: AB's F1 gain per step must exceed ratio x A-only's."""
    n = t["step"]
    ab_s, a_s = t["train_s"][AB], t["train_s"][A2]
    ratio = ab_s / a_s
    f1 = t["f1"]
    late_slope = (
        (f1["a_only_end"] - f1[A2]) / (f1["a_only_end_step"] - n) if f1["a_only_end_step"] > n else 0.0
    )
    needed = (ratio - 1) * n * late_slope
    gain_ab = (f1[AB] - f1["start"]) / n
    gain_a = (f1[A2] - f1["start"]) / n
    o = t["overlap"]
    idle_s = o["wait_packs_s"] + o["fence_s"]
    ratio_no_idle = (o["train_s"] - idle_s) / a_s
    eq = t["equal_wall"]
    a_steps = ", ".join(str(s) for s in eq["a_only_steps"])
    delta = f1["delta_equal_steps"]["value"] if f1["delta_equal_steps"] else float("nan")
    if ratio <= 1:
        takes = (
            f"AB async is no slower per step than A-only 2 cores here ({ratio:.2f}x), so its lead at equal "
            f"steps ({delta:+.3f}) is its lead at equal wall time or better."
        )
    else:
        takes = (
            f"A-only 2 cores gains {late_slope * 1000:+.3f} F1 per 1,000 steps past step {n} (to step "
            f"{f1['a_only_end_step']}), so its extra {ratio - 1:.2f} x {n} steps in AB's time are worth "
            f"{needed:+.3f} F1: AB's lead at equal steps must exceed that (measured {delta:+.3f}). From the "
            f"checkpoint (F1 {f1['start']:.3f}), AB gained {gain_ab * 1000:+.3f} F1 per 1,000 steps and A-only "
            f"{gain_a * 1000:+.3f}"
            + (
                f": AB needs {ratio:.2f}x A-only's gain per step, it had {gain_ab / gain_a:.2f}x."
                if gain_a > 0
                else ": A-only did not gain from the checkpoint, so no per-step ratio applies."
            )
        )
        needed_no_idle = max(0.0, ratio_no_idle - 1) * n * late_slope
        takes += (
            f" With no learner idle (wall ratio {ratio_no_idle:.2f}) the extra A-only steps would be worth "
            f"{needed_no_idle:+.3f} F1, so the same lead would be "
            + ("enough." if delta > needed_no_idle else "still not enough.")
        )
        a_read_s = eq.get("a_only_train_s") or []
        if ratio * n > f1["a_only_end_step"]:
            takes += (
                f" A-only's last eval (step {f1['a_only_end_step']}) comes before AB's training time, so the "
                "equal-wall read gives A-only fewer seconds than AB (in AB's favour)."
            )
        elif a_read_s and min(a_read_s) > eq["ab_train_s"]:
            takes += (
                f" A-only's read (step {f1['a_only_end_step']}, {min(a_read_s):.0f}-{max(a_read_s):.0f} s) had more "
                f"training seconds than AB's {eq['ab_train_s']:.0f} s (in A-only's favour)."
            )
    lines = [
        f"Reading ({task}): {AB} reached step {n} in {ab_s:.0f} s of training vs {A2} {a_s:.0f} s "
        f"(wall ratio per step {ratio:.2f}). At equal steps ΔF1 = {_ci(f1['delta_equal_steps'])}; at equal "
        f"wall time (A-only read at step {a_steps}) ΔF1 = {_ci(eq['delta_f1'])}.",
        "",
        f"What it takes for AB to win at equal wall time here: {takes} Overlap: the learner waited "
        f"{o['wait_packs_s']:.1f} s for packs and {o['fence_s']:.1f} s at weight-sync fences out of "
        f"{o['train_s']:.0f} s (idle {o['idle_fraction']:.0%}) and pushed weights for {o['weight_sync_s']:.1f} s; "
        f"with no idle the wall ratio would be {ratio_no_idle:.2f} (the rest is the weight push and B's own "
        f"cost on one learner core against A-only's two). Mean ver lag {o['ver_lag_mean']:.2f}, drop rate "
        f"{o['drop_rate']:.1%}, realised B share {o['b_ratio_realized']:.2f} (of 0.5 asked).",
    ]
    return lines


def separated_section(r: dict[str, Any]) -> list[str]:
    """The sub-section from `result["separated"]` (`bench.learning_separated`) and the check's sizes."""
    sep = r["separated"]
    sizes = r["sizes"]
    learner, server = sep["cores"]
    reused = sep.get("stage1_reused") or []
    lines = [
        "### Separated placement: async AB vs A-only on the same two cores",
        "",
        f"_Ran {sep['ran_at']}; its runs {sep['phase_s'] / 60:.0f} min one at a time, "
        f"{sep['total_s'] / 60:.0f} min for that invocation"
        + (f" (Stage-1 checkpoints reused: {', '.join(reused)})" if reused else "")
        + "._",
        "",
        f"From the same Stage-1 checkpoints, one run at a time (each owns both cores): **{AB}** (`b_ratio` 0.5, "
        f"{sep['ab_target']}, `channel_b.mode: async` from an embedded hf rollout server with full http weight "
        f"sync every step; learner on CPU {learner}, server and prefetcher on CPU {server}; "
        f"{sizes['phase2_steps']} steps) vs **{A2}** (`b_ratio` 0, the learner pinned to CPUs {learner} and "
        f"{server}, two torch threads; {r['a_only_factor']}x the steps). Same config otherwise, same held-out "
        "greedy eval outside the training seconds; ΔF1 is against A-only 2 cores. These runs are not in the "
        "1-core tables above.",
        "",
    ]
    for task, t in sep["tasks"].items():
        eq = t["equal_wall"]
        lines += [
            f"**{task} task, equal optimizer steps** (step {t['step']}):",
            "",
            *t["table"],
            "",
            f"**{task} task, equal training wall time** ({AB} {eq['ab_train_s']:.0f} s; A-only read at step(s) "
            f"{', '.join(str(s) for s in eq['a_only_steps'])}, after "
            f"{', '.join(f'{x:.0f}' for x in eq['a_only_train_s'])} s per seed):",
            "",
            *eq["table"],
            "",
            f"Mean training seconds to step {t['step']} (rollouts included, eval excluded): "
            + ", ".join(f"{k} {v:.0f} s" for k, v in t["train_s"].items()),
            "",
            *reading(task, t),
            "",
        ]
    return lines[:-1]  # write_markdown adds the blank line after a section
