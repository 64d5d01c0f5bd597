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
            f"{needed:+.3f} F1: AB's lead at equal steps must exceed that (measured "
            f"{_ci(f1['delta_equal_steps'])}). From the "
            f"checkpoint (F1 {f1['start']:.3f}), AB gained {gain_ab * 1000:+.3f} F1 per 1,000 steps and A-only "
            f"{gain_a * 1000:+.3f}"
            + (
                f": AB needs {ratio:.2f}x A-only's gain per step, it had {gain_ab / gain_a:.2f}x."
                if gain_a > 0
                else ": A-only did not gain from the checkpoint, so no per-step ratio applies."
            )
        )
        needed_no_idle = max(0.0, ratio_no_idle - 1) * n * late_slope
        d = f1["delta_equal_steps"] or {"low": float("nan"), "high": float("nan")}
        # a point estimate on one side of the bar whose interval reaches the other settles nothing
        if d["low"] <= needed_no_idle < delta:
            hedge = " on its point estimate (its interval reaches below that)."
        elif delta <= needed_no_idle < d["high"]:
            hedge = " on its point estimate (its interval reaches above that)."
        else:
            hedge = "."
        takes += (
            f" With no learner idle (wall ratio {ratio_no_idle:.2f}) the extra A-only steps would be worth "
            f"{needed_no_idle:+.3f} F1, so the same lead would be "
            + ("enough" if delta > needed_no_idle else "still not enough")
            + hedge
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
        f"{o['drop_rate']:.1%}, realised B share {o['b_ratio_realized']:.2f} (of {t.get('b_ratio_asked', 0.5):g} asked).",
    ]
    return lines


def _arm_b_ratio(rows: list[dict[str, Any]], t: dict[str, Any]) -> list[dict[str, Any]]:
    """The headline rows with AB's `b_ratio` as its runs asked it (results saved before 2026-11-29 hold 0
    in the AB rows: the arm's b_ratio was not carried into them)."""
    asked = t.get("b_ratio_asked")
    return [{**row, "b_ratio": asked} if row["variant"] == AB and asked is not None else row for row in rows]


def separated_section(r: dict[str, Any]) -> list[str]:
    """The sub-section from `result["separated"]` (`bench.learning_separated`) and the check's sizes."""
    sep = r["separated"]
    arm = sep.get("arm") or {"variant": sep.get("ab_target", "clean_prefix"), "b_ratio": 0.5}
    sizes = r["sizes"]
    learner, server = sep["cores"]
    reused = sep.get("stage1_reused") or []
    lines = [
        "### Separated placement: async AB vs A-only on the same two cores",
        "",
        f"_Ran {sep['ran_at']}; its runs {sep['phase_s'] / 60:.0f} min one at a time, "
        f"{sep['total_s'] / 60:.0f} min for that invocation"
        + (f" (Stage-1 checkpoints reused: {', '.join(reused)})" if reused else "")
        + ": `python -m bench learning`, or this phase alone `python -m bench.bench_learning --separated-only "
        "--out DIR`._",
        "",
        f"From the same Stage-1 checkpoints, one run at a time (each owns both cores): **{AB}** (`b_ratio` "
        f"{arm['b_ratio']:g}, {arm['variant']}, `channel_b.mode: async` from an embedded hf rollout server with full http weight "
        f"sync every step; learner on CPU {learner}, server and prefetcher on CPU {server}; "
        f"{sizes['phase2_steps']} steps) vs **{A2}** (`b_ratio` 0, the learner pinned to CPUs {learner} and "
        f"{server}, two torch threads; {r['a_only_factor']}x the steps). Same config otherwise, same held-out "
        "greedy eval outside the training seconds; ΔF1 is against A-only 2 cores. These runs are not in the "
        "1-core tables above.",
        "",
    ]
    for task, t in sep["tasks"].items():
        eq = t["equal_wall"]
        if t.get("headline"):
            h = t["headline"]
            lines += [
                f"**{task} task, the headline: equal training time** ({AB} at step {t['step']}; A-only 2 cores read "
                f"at step(s) {', '.join(str(s) for s in eq['a_only_steps'])}; Δ against A-only 2 cores):",
                "",
                *table(_arm_b_ratio(h["wall"], t)),
                "",
                f"{task} task, equal optimizer steps (step {t['step']}):",
                "",
                *table(_arm_b_ratio(h["steps"], t)),
                "",
                f"Reading ({task}): class-aware ΔAP at equal training time {cell(h['wall'][1]['metrics']['d_AP'], True)} "
                f"({sign(h['wall'][1]['metrics']['d_AP'])}), at equal steps {cell(h['steps'][1]['metrics']['d_AP'], True)} "
                f"({sign(h['steps'][1]['metrics']['d_AP'])}).",
                "",
                "F1 box, as the earlier check read it (`stagectl report`'s tables: their AP intervals are another "
                "200-draw bootstrap of the same AP, so their ends differ from the tables above by a few thousandths):",
                "",
            ]
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


# --- the 1-core check: Stage-1, protocol, screen, confirmation (bench.learning_analysis) ---

COLUMNS = (
    ("AP", "AP"),
    ("d_AP", "ΔAP"),
    ("AP_agnostic", "AP class-agnostic"),
    ("d_AP_agnostic", "ΔAP agn."),
    ("desc_accuracy", "desc accuracy"),
    ("d_desc_accuracy", "Δdesc acc."),
    ("f1", "F1 box"),
    ("f1_desc", "F1 desc"),
    ("d_f1_desc", "ΔF1 desc"),
)


def cell(iv: dict[str, float] | None, signed: bool = False) -> str:
    if iv is None:
        return "—"
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(iv['value'])} [{f.format(iv['low'])}, {f.format(iv['high'])}]"


def sign(iv: dict[str, float] | None) -> str:
    """What an interval of a difference says."""
    if iv is None:
        return "n/a"
    if iv["low"] > 0:
        return "above 0"
    if iv["high"] < 0:
        return "below 0"
    return "not distinguishable from 0"


def table(rows: list[dict[str, Any]], key: str = "metrics") -> list[str]:
    """One line per row that has `key` (its metrics, or its equal-training-time `wall` metrics)."""
    head = "| variant | b_ratio | seeds | " + " | ".join(name for _, name in COLUMNS) + " | training s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        m = row.get(key)
        if m is None:
            continue
        cells = [row["variant"], f"{row['b_ratio']:g}", str(row["seeds"])]
        cells += [cell(m.get(k), signed=k.startswith("d_")) for k, _ in COLUMNS]
        train = row.get("train_s")
        cells.append(f"{train:.0f}" if isinstance(train, float) else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def task_reading(task: str, t: dict[str, Any]) -> list[str]:
    """The task's reading, generated from the intervals."""
    lines = []
    for p in t.get("protocol", []):
        d = p["metrics"].get("d_AP")
        lines.append(
            f"- {p['variant']} ({'LR ' + p['variant'].split('_lr')[1] if '_lr' in p['variant'] else 'LR 1e-4'}) "
            f"at step {t['step']}, seed 0, against the Stage-1 checkpoint: ΔAP {cell(d, True)} ({sign(d)})."
        )
    for row in t.get("confirm", [])[1:]:
        steps, wall, s1 = (
            row["metrics"].get("d_AP"),
            (row.get("wall") or {}).get("d_AP"),
            (row.get("vs_stage1") or {}).get("d_AP"),
        )
        lines.append(
            f"- {row['variant']}, b_ratio {row['b_ratio']:g}, {row['seeds']} seeds: ΔAP vs A-only at equal steps "
            f"{cell(steps, True)} ({sign(steps)}), at equal training time {cell(wall, True)} ({sign(wall)}; A-only "
            f"read at step {', '.join(str(s) for s in row.get('a_only_steps', []))}); vs the Stage-1 checkpoint "
            f"{cell(s1, True)} ({sign(s1)})."
        )
    return lines


def learning_section(r: dict[str, Any]) -> list[str]:
    sizes = r["sizes"]
    sel = r.get("selection") or {}
    lines = [
        "Stage-2 as it is used: `examples/tiny/learn_shapes.yaml` (tiny Qwen3-VL) trained A-only (Stage-1: cosine "
        "from LR 1e-3 down to 1e-4, steps per task below) to a checkpoint; from it, phase 2 for "
        f"{sizes['phase2_steps']} optimizer steps at a constant LR of {sizes['phase2_lr']:g} (Stage-1's final LR; "
        f"A-only runs on to {r['a_only_factor']}x the steps for the equal-training-time read). "
        f"**Screen**: every Channel-B variant at `b_ratio` {r.get('screen_b_ratio', 0.25):g}, seed 0, every task. "
        "**Confirmation**: the two variants with the best mean class-aware ΔAP in the screen (equal steps)"
        + (f" ({', '.join(sel.get('best_two', []))})" if sel.get("best_two") else "")
        + f", {sizes['seeds']} seeds, over `b_ratio` "
        f"{', '.join(f'{b:g}' for b in r.get('sweep_b_ratios', []))} on the sweep task(s) "
        f"({', '.join(r.get('sweep_tasks', []))}) and at the screen's `b_ratio` elsewhere; A-only with every seed. "
        f"{r['workers']} runs at a time, one torch thread each. Greedy held-out eval: class-aware COCO AP "
        "(IoU .50:.95, the score `coord_desc`), class-agnostic AP (COCOeval `useCats = 0`: boxes only), desc "
        "accuracy (share of box matches whose desc is right), F1 box (IoU 0.5, labels ignored) and F1 desc (a hit "
        "needs the right desc). Each cell: mean over seeds [95% interval: bootstrap over seeds, then held-out "
        "images, paired on images, 2,000 draws; AP by pycocotools' evaluate/accumulate on every draw, 200 draws, "
        "`stagectl/report/ap_intervals.py`]. Δ columns: against A-only at the same step (equal steps), or against "
        "A-only read at the eval whose training seconds come closest (equal training time; rollouts included, "
        "evals excluded).",
        "",
    ]
    if sel.get("screen_delta_ap"):
        lines += [
            "Screen, mean class-aware ΔAP vs A-only at equal steps over the tasks (seed 0): "
            + ", ".join(
                f"{k} {v:+.3f}" for k, v in sorted(sel["screen_delta_ap"].items(), key=lambda kv: -kv[1])
            )
            + ".",
            "",
        ]
    if r.get("reading"):
        lines += ["**Reading** (generated from the intervals below):", "", *r["reading"], ""]
    for task, t in r["tasks"].items():
        spec = r["tasks_spec"][task]
        n_eval = sizes["eval_images"][task]
        low = spec.get("min_objects", 1)
        lines += [
            f"### {task} task: {low}-{spec['max_objects']} shapes of {spec['side_fraction'][0]:g}-"
            f"{spec['side_fraction'][1]:g} of a {spec['image_size']} px image, {n_eval} held-out images, "
            f"Stage-1 {sizes['stage1_steps'][task]} steps",
            "",
            *task_reading(task, t),
            "",
        ]
        if not t.get("phase2_run", True):
            c = t["stage1"].get("counts") or {}
            lines += [
                "Phase 2 was not run on this task in the recorded check: the Stage-1 checkpoint does not localise "
                f"its objects (recall {c.get('recall', float('nan')):.3f}, precision "
                f"{c.get('precision', float('nan')):.3f} at IoU 0.5, {c.get('n_pred')} predictions for "
                f"{c.get('n_gt')} objects), so there is no detector for Channel-B to improve at this budget; "
                "its Stage-1 row:",
                "",
                *table(
                    [
                        {
                            "variant": "Stage-1 checkpoint",
                            "b_ratio": 0,
                            "seeds": 1,
                            "metrics": t["stage1"]["metrics"],
                        }
                    ]
                ),
                "",
            ]
            continue
        lines += [
            "**Stage-1 checkpoint and the phase-2 protocol** (ΔAP etc. against the Stage-1 checkpoint):",
            "",
            *table(
                [
                    {
                        "variant": "Stage-1 checkpoint",
                        "b_ratio": 0,
                        "seeds": 1,
                        "metrics": t["stage1"]["metrics"],
                    },
                    *t.get("protocol", []),
                ]
            ),
            "",
            f"**Screen** (seed 0, step {t['step']}; Δ against A-only seed 0), equal optimizer steps:",
            "",
            *table(t.get("screen", [])),
            "",
            "Screen, equal training time:",
            "",
            *table(t.get("screen", []), key="wall"),
            "",
        ]
        if len(t.get("confirm", [])) > 1:
            lines += [
                f"**Confirmation**, equal optimizer steps (step {t['step']}; the A-only row's Δ is against the "
                "Stage-1 checkpoint):",
                "",
                *table(t["confirm"]),
                "",
                "Confirmation, equal training time:",
                "",
                *table(t["confirm"], key="wall"),
                "",
            ]
    lines.append(f"Whole check: {r['total_s'] / 60:.0f} min.")
    if r.get("separated"):
        lines += ["", *separated_section(r)]
    return lines
