"""The learning check's analysis: each task's Stage-1 row, the screen (every Channel-B variant, one seed)
and the confirmation (A-only and the best two variants, every seed, over the b_ratio sweep), at equal
optimizer steps and at equal training wall time, with box vs label metrics and 95% intervals.

Intervals: class-aware and class-agnostic COCO AP by `stagectl.report.ap_intervals` (pycocotools' own
evaluate/accumulate on bootstrap draws: seeds, then held-out images, one image draw per task shared by every
run so differences are paired on images); F1 (box-only), desc-aware F1 and desc accuracy by
`stagectl.report.intervals` from the per-image counters. Runs are grouped by their directory names
(`bench.bench_learning.run_name`).

Equal wall time: each AB group at `phase2_steps` against each A-only seed read at its eval step whose
cumulative training seconds (rollouts included, evals excluded) come closest to the group's mean.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.learning_jobs import AB_VARIANTS, run_finished, slug
from stagectl.report.ap_intervals import image_draws, interval, load_run_ap, resampled_ap, seed_means
from stagectl.report.compare import RunEval, load_run
from stagectl.report.intervals import Interval, counts_from_row, difference_intervals, variant_intervals

AP_RESAMPLES = 200
COUNT_METRICS = ("f1", "f1_desc", "desc_accuracy", "precision", "recall")
STAGE1_EVAL = "stage1-eval"  # a Stage-1 run from before eval_predictions.jsonl gets its eval re-run here


@dataclass(frozen=True)
class Run:
    name: str
    variant: str  # "A-only", "A-only_lr0.0003" or an AB_VARIANTS key
    b_ratio: float
    seed: int
    eval: RunEval


def parse_name(task: str, name: str) -> tuple[str, float, int] | None:
    """(variant, b_ratio, seed) from a phase-2 run dir name, None for anything else."""
    found = re.fullmatch(rf"{re.escape(task)}-(.+?)(?:-b([0-9.]+))?-seed(\d+)", name)
    if found is None:
        return None
    names = {slug(v): v for v in AB_VARIANTS}
    variant = names.get(found.group(1), found.group(1)) if found.group(2) else found.group(1)
    return variant, float(found.group(2) or 0), int(found.group(3))


def finished_runs(out: Path, task: str) -> list[Run]:
    runs = []
    for path in sorted(out.glob(f"{task}-*-seed*")):
        parsed = parse_name(task, path.name)
        if parsed is None or not run_finished(path):
            continue
        runs.append(Run(path.name, *parsed, load_run(path)))
    return runs


class Metrics:
    """Box and label metrics of run groups at given steps, intervals from one image draw per task."""

    def __init__(self, num_images: int) -> None:
        self.draws = image_draws(num_images, AP_RESAMPLES, seed=0)
        self._ap: dict[tuple[Path, int, bool], tuple[float, np.ndarray]] = {}

    def _ap_of(self, run_dir: Path, step: int, use_cats: bool) -> tuple[float, np.ndarray]:
        key = (run_dir, step, use_cats)
        if key not in self._ap:
            run = load_run_ap(run_dir, step, use_cats=use_cats)
            self._ap[key] = (run.ap(np.arange(len(run.image_ids))), resampled_ap(run, self.draws))
        return self._ap[key]

    def summary(
        self,
        group: list[tuple[Path, dict[str, Any], int]],
        baseline: list[tuple[Path, dict[str, Any], int]] | None,
    ) -> dict[str, Any]:
        """`group` / `baseline`: (run dir, eval row, step) per seed. Every metric with its interval, and the
        difference to the baseline's."""
        out: dict[str, Any] = {}
        for key, use_cats in (("AP", True), ("AP_agnostic", False)):
            rng = np.random.default_rng(1)
            values = [self._ap_of(path, step, use_cats) for path, _, step in group]
            observed = float(np.mean([v[0] for v in values]))
            boot = seed_means([v[1] for v in values], rng)
            out[key] = interval(observed, boot)
            if baseline:
                base = [self._ap_of(path, step, use_cats) for path, _, step in baseline]
                out["d_" + key] = interval(
                    observed - float(np.mean([v[0] for v in base])),
                    boot - seed_means([v[1] for v in base], rng),
                )
        counts = [counts_from_row(row) for _, row, _ in group]
        ivs = variant_intervals(counts)
        out.update({k: ivs[k] for k in COUNT_METRICS})
        if baseline:
            diff = difference_intervals(counts, [counts_from_row(row) for _, row, _ in baseline])
            out.update({"d_" + k: diff[k] for k in COUNT_METRICS})
        return out


def _at(run: Run, step: int) -> tuple[Path, dict[str, Any], int]:
    return run.eval.path, run.eval.evals[step], step


def _wall_read(a_runs: list[Run], wall: float) -> list[tuple[Path, dict[str, Any], int]]:
    """Each A-only run at its eval step whose cumulative training seconds come closest to `wall`."""
    reads = []
    for run in a_runs:
        step = min(run.eval.evals, key=lambda s: abs(run.eval.train_s_at.get(s, float("inf")) - wall))
        reads.append(_at(run, step))
    return reads


def _row(
    label: str, b_ratio: float, runs: list[Run], summary: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    return {"variant": label, "b_ratio": b_ratio, "seeds": len(runs), **extra, "metrics": summary}


def stage1_eval_dir(out: Path, task: str) -> Path:
    """The Stage-1 checkpoint's eval with its predictions: the Stage-1 run itself when it wrote them, else
    `{task}-stage1-eval/` (the same evaluator re-run on the checkpoint)."""
    run_dir = out / f"{task}-stage1"
    if (run_dir / "eval_predictions.jsonl").is_file():
        return run_dir
    return out / f"{task}-{STAGE1_EVAL}"


def ensure_stage1_eval(out: Path, task: str, config: Path, checkpoint: Path) -> None:
    """Re-run the held-out eval on the Stage-1 checkpoint into `{task}-stage1-eval/` when the Stage-1 run
    wrote no predictions (it ran before train-ab wrote `eval_predictions.jsonl`): the same evaluator, config
    and images, so its metrics equal the Stage-1 run's own last eval row (greedy decoding)."""
    target = out / f"{task}-{STAGE1_EVAL}"
    if stage1_eval_dir(out, task) != target or (target / "eval_predictions.jsonl").is_file():
        return
    from stagectl.config import load_config
    from stagectl.config.plan import eval_plan
    from stagectl.detection.vocab import TokenVocab
    from stagectl.learner.evaluate import Evaluator
    from stagectl.models.loading import load_bundle

    step = int(json.loads((out / f"{task}-stage1" / "eval.jsonl").read_text().splitlines()[-1])["step"])
    cfg = load_config(
        str(config),
        [f"model.name_or_path={checkpoint}", f"training.output_dir={target}", "stage2_ab.schedule.b_ratio=0"],
    )
    target.mkdir(parents=True, exist_ok=True)
    bundle = load_bundle(str(checkpoint), torch_dtype=cfg.model.torch_dtype, add_coord_tokens=True)
    Evaluator(eval_plan(cfg), cfg.training, bundle, TokenVocab.from_tokenizer(bundle.tokenizer)).run(step)


def analyse_task(out: Path, task: str, phase2_steps: int, screen_b: float) -> dict[str, Any] | None:
    """Everything the task's section of BENCHMARKS.md shows (None without a Stage-1 eval with predictions;
    only the Stage-1 row when no A-only run finished)."""
    runs = finished_runs(out, task)
    a_only = [r for r in runs if r.variant == "A-only"]
    stage1_dir = stage1_eval_dir(out, task)
    if not (stage1_dir / "eval_predictions.jsonl").is_file():
        return None
    stage1_row = [json.loads(line) for line in (stage1_dir / "eval.jsonl").read_text().splitlines()][-1]
    stage1_step = int(stage1_row["step"])
    metrics = Metrics(len(stage1_row["per_image"]))
    stage1 = [(stage1_dir, stage1_row, stage1_step)]
    n = phase2_steps
    a_seed0 = [r for r in a_only if r.seed == 0]
    result: dict[str, Any] = {
        "step": n,
        "stage1": {"step": stage1_step, "metrics": metrics.summary(stage1, None)},
    }
    result["stage1"]["counts"] = {
        k: stage1_row.get(k) for k in ("n_gt", "n_pred", "recall", "precision", "AP50_agnostic")
    }
    if not a_only:  # Stage-1 only: phase 2 was not run on this task
        result.update(protocol=[], screen=[], confirm=[], phase2_run=False)
        return result
    result["phase2_run"] = True

    # the protocol: A-only at Stage-1's final LR and at the old LR, both against the Stage-1 checkpoint
    protocol = []
    for label, group in (
        ("A-only", a_seed0),
        *[(r.variant, [r]) for r in runs if r.variant.startswith("A-only_lr")],
    ):
        if group and n in group[0].eval.evals:
            protocol.append(_row(label, 0, group, metrics.summary([_at(group[0], n)], stage1)))
    result["protocol"] = protocol

    # the screen: seed 0 of every variant at the screen's b_ratio
    screen = []
    for run in [r for r in runs if r.seed == 0 and r.b_ratio == screen_b and r.variant != "A-only"]:
        if n not in run.eval.evals:
            continue
        wall = run.eval.train_s_at.get(n, float("nan"))
        screen.append(
            _row(
                run.variant,
                run.b_ratio,
                [run],
                metrics.summary([_at(run, n)], [_at(r, n) for r in a_seed0]),
                wall=metrics.summary([_at(run, n)], _wall_read(a_seed0, wall)),
                train_s=wall,
                a_only_steps=[s for _, _, s in _wall_read(a_seed0, wall)],
            )
        )
    result["screen"] = screen

    # the confirmation: every seed of A-only and of each (variant, b_ratio) group that has more than one seed
    groups: dict[tuple[str, float], list[Run]] = {}
    for run in runs:
        if run.variant != "A-only" and not run.variant.startswith("A-only_") and n in run.eval.evals:
            groups.setdefault((run.variant, run.b_ratio), []).append(run)
    a_all = [r for r in a_only if n in r.eval.evals]
    confirm = [
        _row(
            "A-only",
            0,
            a_all,
            metrics.summary([_at(r, n) for r in a_all], stage1),
            train_s=float(np.mean([r.eval.train_s_at.get(n, float("nan")) for r in a_all])),
        )
    ]
    for (variant, b_ratio), members in sorted(groups.items()):
        if len(members) < 2:
            continue
        wall = float(np.mean([r.eval.train_s_at.get(n, float("nan")) for r in members]))
        reads = _wall_read(a_all, wall)
        at_n = [_at(r, n) for r in members]
        confirm.append(
            _row(
                variant,
                b_ratio,
                members,
                metrics.summary(at_n, [_at(r, n) for r in a_all]),
                wall=metrics.summary(at_n, reads),
                vs_stage1=metrics.summary(at_n, stage1),
                train_s=wall,
                a_only_steps=sorted({s for _, _, s in reads}),
            )
        )
    result["confirm"] = confirm
    result["a_only_train_s"] = (
        {
            step: float(np.mean([r.eval.train_s_at.get(step, float("nan")) for r in a_all]))
            for step in sorted(a_all[0].eval.evals)
        }
        if a_all
        else {}
    )
    return result


def as_json(value: Any) -> Any:
    """Intervals as {value, low, high} (for bench/results/learning.json)."""
    if isinstance(value, Interval):
        return {"value": value.value, "low": value.low, "high": value.high}
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    return value


def _fmt(iv: dict[str, float]) -> str:
    return f"{iv['value']:+.3f} [{iv['low']:+.3f}, {iv['high']:+.3f}]"


def overall_reading(tasks: dict[str, dict[str, Any]]) -> list[str]:
    """The check's answer, from the confirmation intervals (`as_json` form): per task the best AB group at equal training
    time, whether any task has AB above A-only there with an interval above 0, and whether Stage-2's best
    arm (A-only included) is above the Stage-1 checkpoint."""
    lines, wins, above_stage1 = [], [], []
    for task, t in tasks.items():
        groups = [row for row in t.get("confirm", [])[1:] if row.get("wall")]
        a_row = (t.get("confirm") or [None])[0]
        if groups:
            best = max(groups, key=lambda row: row["wall"]["d_AP"]["value"])
            d = best["wall"]["d_AP"]
            if d["low"] > 0:
                wins.append(task)
            lines.append(
                f"- {task}: the best AB arm at equal training time is {best['variant']} at b_ratio "
                f"{best['b_ratio']:g}: class-aware ΔAP vs A-only {_fmt(d)}, class-agnostic "
                f"{_fmt(best['wall']['d_AP_agnostic'])}, desc accuracy {_fmt(best['wall']['d_desc_accuracy'])}, "
                f"F1 desc {_fmt(best['wall']['d_f1_desc'])}; at equal steps ΔAP {_fmt(best['metrics']['d_AP'])}."
            )
        arms = [(row["variant"], row["b_ratio"], row.get("vs_stage1", {}).get("d_AP")) for row in groups]
        if a_row is not None:
            arms.append(("A-only", 0.0, a_row["metrics"].get("d_AP")))
        arms = [a for a in arms if a[2] is not None]
        if arms:
            name, b_ratio, d = max(arms, key=lambda a: a[2]["value"])
            if d["low"] > 0:
                above_stage1.append(task)
            label = name if name == "A-only" else f"{name} at b_ratio {b_ratio:g}"
            lines.append(
                f"- {task}: Stage-2's best arm at equal steps, {label}, vs the Stage-1 checkpoint: ΔAP {_fmt(d)}."
            )
    lines.append(
        "- Goal, AB above A-only on class-aware AP at equal training time with an interval above 0 on at least "
        "one task: " + (f"met ({', '.join(wins)})." if wins else "not met on any task.")
    )
    lines.append(
        "- Goal, Stage-2's best arm above the Stage-1 checkpoint (interval above 0): "
        + (f"met ({', '.join(above_stage1)})." if above_stage1 else "not met on any task.")
    )
    return lines


def wall_deltas(out: Path, task: str, phase2_steps: int) -> dict[tuple[str, float], float]:
    """Per confirmed (variant, b_ratio) group: its mean class-aware AP at `phase2_steps` minus A-only's read
    at equal training time, from the eval rows alone (the observed value of the confirmation's `wall` ΔAP,
    without the bootstrap: what the separated phase needs to choose its arm)."""
    runs = finished_runs(out, task)
    a_all = [r for r in runs if r.variant == "A-only" and phase2_steps in r.eval.evals]
    groups: dict[tuple[str, float], list[Run]] = {}
    for run in runs:
        if not run.variant.startswith("A-only") and phase2_steps in run.eval.evals:
            groups.setdefault((run.variant, run.b_ratio), []).append(run)
    out_deltas = {}
    for key, members in groups.items():
        if len(members) < 2 or not a_all:
            continue
        wall = float(np.mean([r.eval.train_s_at.get(phase2_steps, float("nan")) for r in members]))
        a_ap = np.mean([float(row["AP"]) for _, row, _ in _wall_read(a_all, wall)])
        out_deltas[key] = float(np.mean([float(r.eval.evals[phase2_steps]["AP"]) for r in members]) - a_ap)
    return out_deltas
