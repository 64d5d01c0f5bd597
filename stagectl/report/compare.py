"""`stagectl report RUN_DIR RUN_DIR ...`: compare train-ab runs (an A-only vs AB ablation, several seeds
each) on their held-out eval at equal optimizer steps, with 95% intervals (`stagectl.report.intervals`).

Runs are grouped into variants by what their `config.yaml` says about Channel-B (`b_ratio`, `target`,
`insertion_order`); the seeds of a variant are its runs. The step compared is the largest eval step every
run reached (or the one asked for). Differences are against the A-only variant when there is one.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from stagectl.files import atomic_write_bytes, atomic_write_text
from stagectl.report.intervals import (
    Interval,
    counts_from_row,
    difference_intervals,
    variant_intervals,
)
from stagectl.report.jsonl import read_jsonl
from stagectl.rundir.ending import read_run_end

EVAL = "eval.jsonl"
METRICS_FILE = "metrics.jsonl"


@dataclass
class RunEval:
    path: Path
    variant: str
    seed: int | None
    evals: dict[int, dict[str, Any]]  # step -> eval row
    train_s_at: dict[int, float] = field(default_factory=dict)  # step -> cumulative training seconds
    notes: list[str] = field(default_factory=list)  # what a reader must know: lines skipped, how it ended
    eval_setup: dict[str, Any] = field(default_factory=dict)  # `EVAL_SETUP_KEYS` of its config's data.eval


def variant_of(config: dict[str, Any]) -> str:
    """`A-only`, or `AB b=<ratio> <target>[/sorted]` plus the target knobs off their defaults, from a run's resolved config."""
    ab = config.get("stage2_ab") or {}
    ratio = Fraction(str((ab.get("schedule") or {}).get("b_ratio", 0)))
    if ratio == 0:
        return "A-only"
    cb = ab.get("channel_b") or {}
    label = f"AB b={float(ratio):g} {cb.get('target', 'raw_prefix')}"
    if cb.get("insertion_order", "tail_append") == "sorted":
        label += "/sorted"
    # Knobs off their defaults name the variant too, so runs that differ only in them are not pooled as seeds.
    matched = float(cb.get("desc_ce_weight_matched", 0.0))
    if matched:
        label += f" desc_matched={matched:g}"
        if not cb.get("mask_correct_matched_desc", True):
            label += "/unmasked"
    match = cb.get("match") or {}
    if match.get("assignment", "hungarian") != "hungarian":
        label += f" {match['assignment']}"
    if match.get("desc_gated", False):
        label += " desc_gated"
    return label


def load_run(run_dir: Path) -> RunEval:
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise ValueError(f"{run_dir} is not a train-ab run dir (no config.yaml)")
    config = yaml.safe_load(config_path.read_text()) or {}
    # a torn last line (an interrupted run) is skipped and noted, as in a single run's report
    eval_file, metrics = read_jsonl(run_dir / EVAL), read_jsonl(run_dir / METRICS_FILE)
    evals = {int(row["step"]): row for row in eval_file.rows if isinstance(row.get("step"), int)}
    if not evals:
        raise ValueError(f"{run_dir} has no held-out eval rows ({EVAL}); set data.eval to compare runs")
    train_s_at: dict[int, float] = {}
    total = 0.0
    for row in metrics.rows:
        if "step" in row and "time/step_s" in row:
            total += float(row["time/step_s"])
            train_s_at[int(row["step"]) + 1] = total  # metrics rows count from 0; evals after step s+1
    seed = (config.get("training") or {}).get("seed")
    notes = [f"`{run_dir}`: {note}" for note in eval_file.notes() + metrics.notes()]
    end = read_run_end(run_dir)
    if end is not None and not end.finished:  # a failed or stopped run: why the compared step may be early
        notes.append(f"`{run_dir}` did not finish: {end.describe()}.")
    return RunEval(run_dir, variant_of(config), seed, evals, train_s_at, notes, eval_setup(config))


# `data.eval` keys that decide which images are evaluated and how they are answered and scored: runs that
# differ in one have numbers that cannot be compared, let alone paired image by image (`every_steps` and
# `gallery_images` only say when and what is drawn)
EVAL_SETUP_KEYS = ("jsonl", "image_root", "synthetic", "max_samples", "decoding", "score")


def eval_setup(config: dict[str, Any]) -> dict[str, Any]:
    """The `EVAL_SETUP_KEYS` of a resolved config's `data.eval`, as written (a key not written: None)."""
    section = (config.get("data") or {}).get("eval") or {}
    return {key: section.get(key) for key in EVAL_SETUP_KEYS}


def check_distinct(runs: Sequence[RunEval]) -> None:
    """ValueError when one run dir is given twice (`runs/a runs/a/`, an overlapping glob): it would count as
    two seeds and narrow the intervals."""
    seen: dict[Path, Path] = {}
    for run in runs:
        key = run.path.resolve()
        if key in seen:
            raise ValueError(f"{run.path} is given twice (also as {seen[key]}); each run counts as one seed")
        seen[key] = run.path


def check_same_eval(runs: Sequence[RunEval]) -> None:
    """ValueError naming the first `data.eval` key the runs differ in: the comparison pairs images across
    runs (image k of one run against image k of another), so they must have evaluated the same images the
    same way."""
    first = runs[0]
    for run in runs[1:]:
        for key in EVAL_SETUP_KEYS:
            if run.eval_setup[key] != first.eval_setup[key]:
                raise ValueError(
                    f"the runs were evaluated differently: data.eval.{key} is {first.eval_setup[key]!r} in "
                    f"{first.path} but {run.eval_setup[key]!r} in {run.path}; the comparison pairs held-out "
                    "images across runs, so compare runs evaluated on the same data.eval split with the same "
                    "max_samples, decoding and score"
                )


@dataclass(frozen=True)
class VariantRow:
    variant: str
    num_seeds: int
    step: int
    metrics: dict[str, Interval]
    per_seed_f1: list[float]
    vs_baseline: dict[str, Interval] | None  # None for the baseline itself or when there is none
    # class-aware COCO AP and its difference to the baseline, when every run wrote its eval predictions
    ap: Interval | None = None
    ap_vs_baseline: Interval | None = None


def group(runs: Sequence[RunEval]) -> dict[str, list[RunEval]]:
    out: dict[str, list[RunEval]] = {}
    for run in runs:
        out.setdefault(run.variant, []).append(run)
    return dict(sorted(out.items(), key=lambda kv: (kv[0] != "A-only", kv[0])))


def common_step(runs: Sequence[RunEval]) -> int:
    steps = set.intersection(*(set(r.evals) for r in runs))
    if not steps:
        raise ValueError("the runs share no eval step; compare runs evaluated at the same steps")
    return max(steps)


def compare_at(
    runs: Sequence[RunEval], step_of: dict[Path, int], baseline: str = "A-only"
) -> list[VariantRow]:
    """One row per variant, each run read at `step_of[run.path]` (equal steps, or equal wall time)."""
    groups = group(runs)
    counts = {name: [_counts(r, step_of[r.path]) for r in members] for name, members in groups.items()}
    rows = []
    for name, members in groups.items():
        f1s = [variant_intervals([c])["f1"].value for c in counts[name]]
        diff = None
        if baseline in counts and name != baseline:
            diff = difference_intervals(counts[name], counts[baseline])
        steps = {step_of[r.path] for r in members}
        rows.append(VariantRow(name, len(members), max(steps), variant_intervals(counts[name]), f1s, diff))
    return _with_ap(rows, groups, step_of, baseline)


def _counts(run: RunEval, step: int) -> np.ndarray:
    """The per-image counters of `run`'s eval at `step`; ValueError naming the run and step without them."""
    try:
        return counts_from_row(run.evals[step])
    except ValueError as exc:
        raise ValueError(f"{run.path / EVAL} step {step}: {exc}") from None


AP_RESAMPLES = 200


def _with_ap(
    rows: list[VariantRow], groups: dict[str, list[RunEval]], step_of: dict[Path, int], baseline: str
) -> list[VariantRow]:
    """`rows` with AP intervals (`stagectl.report.ap_intervals`, one image draw shared by every run), when
    every run has `eval_predictions.jsonl` (runs from before it keep AP out of the table)."""
    from dataclasses import replace

    from stagectl.report.ap_intervals import (
        PREDICTIONS_FILE,
        image_draws,
        interval,
        load_run_ap,
        resampled_ap,
        seed_means,
    )

    runs = [r for members in groups.values() for r in members]
    if not all((r.path / PREDICTIONS_FILE).is_file() for r in runs):
        return rows
    loaded = {r.path: load_run_ap(r.path, step_of[r.path]) for r in runs}
    for r in runs:
        r.notes += [f"`{r.path}`: {note}" for note in loaded[r.path].notes]
    sizes = {len(a.image_ids) for a in loaded.values()}
    if len(sizes) != 1:
        return rows
    draws = image_draws(sizes.pop(), AP_RESAMPLES)
    everything = np.arange(draws.shape[1])
    observed = {path: a.ap(everything) for path, a in loaded.items()}
    boot = {path: resampled_ap(a, draws) for path, a in loaded.items()}
    rng = np.random.default_rng(1)
    per_group = {
        name: (
            float(np.mean([observed[r.path] for r in members])),
            seed_means([boot[r.path] for r in members], rng),
        )
        for name, members in groups.items()
    }
    out = []
    for row in rows:
        value, samples = per_group[row.variant]
        delta = None
        if baseline in per_group and row.variant != baseline:
            base_value, base_samples = per_group[baseline]
            delta = interval(value - base_value, samples - base_samples)
        out.append(replace(row, ap=interval(value, samples), ap_vs_baseline=delta))
    return out


def compare(runs: Sequence[RunEval], step: int | None = None) -> tuple[int, list[VariantRow]]:
    """Every variant at one optimizer step (default: the largest eval step all runs share); the runs must
    be distinct and share their eval setup (`check_distinct`, `check_same_eval`)."""
    check_distinct(runs)
    check_same_eval(runs)
    at = common_step(runs) if step is None else step
    missing = [str(r.path) for r in runs if at not in r.evals]
    if missing:
        raise ValueError(f"no eval at step {at} in: {', '.join(missing)}")
    return at, compare_at(runs, {r.path: at for r in runs})


def _ci(iv: Interval, signed: bool = False) -> str:
    if np.isnan(iv.value):  # eval rows from before the desc-aware counter
        return "—"
    sign = "+" if signed else ""
    return f"{iv.value:{sign}.3f} [{iv.low:{sign}.3f}, {iv.high:{sign}.3f}]"


def render_table(rows: Sequence[VariantRow]) -> list[str]:
    """Markdown: each metric with its 95% interval, then AP and F1 minus the baseline's (paired on images).
    F1 is box-only (class-agnostic, IoU 0.5); F1 desc counts a hit only with the right desc; desc accuracy
    is the share of box hits whose desc is right (docs/evaluation.md). AP columns when the runs wrote their
    eval predictions."""
    with_ap = all(r.ap is not None for r in rows)
    head = ["variant", "seeds", "step"]
    head += ["AP", "ΔAP vs A-only"] if with_ap else []
    head += [
        "F1 box",
        "F1 desc",
        "desc accuracy",
        "precision",
        "recall",
        "invalid rollouts",
        "duplicate rate",
    ]
    head += ["ΔF1 vs A-only", "F1 per seed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        m = r.metrics
        cells = [r.variant, str(r.num_seeds), str(r.step)]
        if with_ap:
            assert r.ap is not None
            cells += [_ci(r.ap), _ci(r.ap_vs_baseline, signed=True) if r.ap_vs_baseline else "—"]
        cells += [
            _ci(m[k])
            for k in ("f1", "f1_desc", "desc_accuracy", "precision", "recall", "invalid_rate", "dup_rate")
        ]
        cells.append(_ci(r.vs_baseline["f1"], signed=True) if r.vs_baseline else "—")
        cells.append(" ".join(f"{v:.3f}" for v in r.per_seed_f1))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def f1_curves(runs: Sequence[RunEval]) -> dict[str, list[tuple[int, float, float, float]]]:
    """Per variant: (step, mean F1 over seeds, min, max) at every step all its seeds were evaluated."""
    out = {}
    for name, members in group(runs).items():
        steps = sorted(set.intersection(*(set(r.evals) for r in members)))
        curve = []
        for s in steps:
            values = np.asarray([float(r.evals[s]["f1"]) for r in members])
            curve.append((s, float(values.mean()), float(values.min()), float(values.max())))
        out[name] = curve
    return out


def plot_f1_curves(
    runs: Sequence[RunEval], path: Path, title: str = "held-out F1", start_f1: float | None = None
) -> Path:
    """One PNG: mean F1 over seeds per variant against optimizer steps, the seed range shaded (and the
    starting checkpoint's F1 at step 0 when given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    if start_f1 is not None:
        ax.plot([0], [start_f1], "k*", markersize=10, label="start checkpoint")
    for name, curve in f1_curves(runs).items():
        steps = [c[0] for c in curve]
        ax.plot(steps, [c[1] for c in curve], marker="o", label=name)
        ax.fill_between(steps, [c[2] for c in curve], [c[3] for c in curve], alpha=0.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out F1 (IoU 0.5)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, dpi=100, format="png")
    plt.close(fig)
    atomic_write_bytes(path, image.getvalue())  # an earlier comparison's plot stays whole until this one is
    return path


def write_comparison(
    run_dirs: Sequence[Path], out_dir: Path, step: int | None = None
) -> tuple[Path, list[str], list[str]]:
    """`out_dir/comparison.md` (+ `comparison_f1.png`); returns the report path, its table lines and its notes
    (lines skipped, runs that did not finish). `ValueError` naming the path, before any run is read, when
    `out_dir` cannot hold them."""
    from stagectl.files import check_output_dir

    for name in ("comparison.md", "comparison.html", "comparison_f1.png"):
        if (out_dir / name).is_dir():
            raise ValueError(
                f"--out: cannot write {out_dir / name}: it is a directory, not a file; move it away"
            )
    check_output_dir(out_dir, key="--out")
    runs = [load_run(p) for p in run_dirs]
    at, rows = compare(runs, step)
    table = render_table(rows)
    notes = [note for run in runs for note in run.notes]
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = plot_f1_curves(runs, out_dir / "comparison_f1.png")
    lines = [
        "# Run comparison",
        "",
        f"Held-out eval at optimizer step {at}; each metric is the mean over a variant's runs (seeds) with a 95% "
        "interval from a bootstrap over seeds and held-out images (paired on images across variants).",
        "",
        *table,
        "",
        "Runs: " + ", ".join(f"`{r.path}` ({r.variant}, seed {r.seed})" for r in runs),
        "",
        f"![held-out F1]({plot.name})",
        "",
        *(["## Notes", "", *(f"- {note}" for note in notes), ""] if notes else []),
    ]
    report = out_dir / "comparison.md"
    atomic_write_text(report, "\n".join(lines))
    from stagectl.report.html import comparison_page, write_html

    write_html(out_dir, comparison_page(out_dir, lines[2], table, plot, run_dirs), "comparison.html")
    return report, table, notes
