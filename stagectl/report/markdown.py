"""report.md text (pure): the summary tables, the linked plots, what was not plotted and why."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from stagectl.report.sections import Figures
from stagectl.report.stage_b import StageBSummary
from stagectl.report.train_ab import Best, EvalSummary, TrainAbSummary

NA = "n/a"
MAX_EXPERIENCE_CHARS = 160


def fmt(value: float | int | None, digits: int = 4) -> str:
    """Integers with thousands separators, floats to `digits` significant digits, None as n/a."""
    if value is None:
        return NA
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    if abs(value) >= 10**digits:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def fmt_ratio(value: Fraction | None) -> str:
    if value is None:
        return NA
    if value.denominator == 1 or float(value) == round(float(value), 4):
        return fmt(float(value))
    return f"{value} ({float(value):.4f})"


def fmt_best(best: Best | None) -> str:
    return NA if best is None else f"{best.value:.4f} (step {best.step})"


def fmt_steps(steps: Sequence[int], limit: int = 12) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


def table(rows: Sequence[tuple[str, str]], header: tuple[str, str] = ("metric", "value")) -> list[str]:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return lines


def b_steps_rows(b_steps: dict[str, Any] | None) -> list[tuple[str, str]]:
    """`final_state.json`'s B-step ledger: wanted / trained over the whole run, and why the rest were A."""
    if b_steps is None:
        return []
    reasons = ", ".join(f"{reason} {n}" for reason, n in b_steps.get("b_steps_as_a", {}).items())
    return [
        (
            "B steps wanted / trained (whole run, `final_state.json`)",
            f"{b_steps.get('b_steps_wanted', NA)} / {b_steps.get('b_steps_trained', NA)}",
        ),
        ("wanted B steps trained as A, by reason", reasons or "none"),
    ]


def train_ab_rows(s: TrainAbSummary, ev: EvalSummary | None) -> list[tuple[str, str]]:
    rows = [
        (
            "optimizer steps logged",
            f"{s.num_steps} (steps {s.first_step}–{s.last_step}; steps here count from 0 as `metrics.jsonl` "
            f"does: the console's `step {s.first_step + 1}/N` is step {s.first_step})",
        ),
        ("Channel-A / Channel-B steps", f"{s.num_a} / {s.num_b}"),
        ("B ratio: realised / target", f"{s.realised_b_ratio:.4f} / {fmt_ratio(s.target_b_ratio)}"),
        ("B steps wanted by the schedule", str(s.num_wanted_b)),
        (
            "skip-to-A steps (wanted B, trained A)",
            f"{len(s.skip_steps)}" + (f" (step {fmt_steps(s.skip_steps)})" if s.skip_steps else ""),
        ),
        *b_steps_rows(s.b_steps),
        ("rollout F1 on B steps: last / best", f"{fmt_best(s.f1_last)} / {fmt_best(s.f1_best)}"),
        ("rollout precision / recall (last B step)", f"{fmt(s.precision_last)} / {fmt(s.recall_last)}"),
    ]
    if ev is not None:
        rows.append(("held-out eval F1: last / best", f"{fmt_best(ev.f1_last)} / {fmt_best(ev.f1_best)}"))
        if ev.ap_last is not None:
            rows.append(("held-out eval AP: last / best", f"{fmt_best(ev.ap_last)} / {fmt_best(ev.ap_best)}"))
        if ev.ap_agnostic_last is not None:
            rows += [
                (
                    "held-out eval (last) AP class-agnostic / with constant scores",
                    f"{fmt(ev.ap_agnostic_last)} / {fmt(ev.ap_constant_score_last)}",
                ),
                (
                    "held-out eval (last) desc accuracy on matched pairs / F1 desc-aware",
                    f"{fmt(ev.desc_accuracy_last)} / {fmt(ev.f1_desc_last)}",
                ),
                (
                    "held-out eval (last) share of the most common predicted desc",
                    fmt(ev.pred_desc_top_share_last),
                ),
            ]
    if s.b_fill_mean is not None:
        rows.append(
            (
                "Channel-B pack fill (`packing/b_fill`): mean / min",
                f"{fmt(s.b_fill_mean)} / {fmt(s.b_fill_min)} (step {s.b_fill_min_step})",
            )
        )
    if s.is_async:
        rows += [
            ("dropped packs: stale / oldest", f"{fmt(s.drop_stale_total)} / {fmt(s.drop_oldest_total)}"),
            ("prefetches: ok / failed", f"{fmt(s.prefetch_success_total)} / {fmt(s.prefetch_fail_total)}"),
            ("weight syncs: total / failed", f"{fmt(s.sync_total)} / {fmt(s.sync_fail_total)}"),
            ("ver_lag on B steps: mean / max", f"{fmt(s.ver_lag_mean)} / {fmt(s.ver_lag_max)}"),
        ]
    if s.num_weight_syncs:
        rows += [
            (
                "weight syncs: time total / mean MB/s",
                f"{s.sync_s_total:.2f} s / {fmt(s.sync_mb_per_s_mean)} ({s.num_weight_syncs} syncs, "
                f"{s.num_delta_syncs} delta)",
            ),
            (
                "weight syncs: MB sent / of state dicts",
                f"{s.sync_mb_sent:.1f} / {s.sync_mb_state:.1f}",
            ),
            (
                "weight sync share of its step: mean / max",
                f"{fmt(s.sync_step_fraction_mean)} / {fmt(s.sync_step_fraction_max)}",
            ),
        ]
    rows += [
        ("tokens trained (all ranks)", fmt(s.tokens_total)),
        ("throughput", f"{fmt(s.tokens_per_s, 5)} tokens/s (tokens / summed step time)"),
        ("summed step time / of it waiting", f"{s.step_time_total_s:.1f} s / {s.wait_total_s:.1f} s"),
        ("mean step time A / B", f"{fmt(s.mean_step_s_a)} s / {fmt(s.mean_step_s_b)} s"),
    ]
    return rows


def render_train_ab(
    title: str,
    subtitle: str,
    summary: TrainAbSummary,
    ev: EvalSummary | None,
    figures: Figures,
    plot_dir: str,
    notes: Sequence[str],
) -> str:
    lines = [f"# {title}", "", subtitle, "", "## Summary", ""]
    lines += table(train_ab_rows(summary, ev))
    lines += ["", "## Loss per term", "", "| term | first | last | change | min |", "|---|---|---|---|---|"]
    for t in summary.terms:
        lines.append(
            f"| `{t.term}` | {fmt(t.first)} (step {t.first_step}) | {fmt(t.last)} (step {t.last_step}) "
            f"| {t.last - t.first:+.4g} | {fmt(t.min)} |"
        )
    if not summary.terms:
        lines.append(f"| (no loss keys logged) | {NA} | {NA} | {NA} | {NA} |")
    lines += _figures(figures, plot_dir) + _notes(notes)
    return "\n".join(lines) + "\n"


EVAL_SHOWN = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "f1", "precision", "recall")
# box vs label (the metrics.json of an eval before them has none: those rows are left out)
EVAL_LABEL_SHOWN = (
    ("AP_agnostic", "AP class-agnostic (COCOeval useCats=0)"),
    ("AP50_agnostic", "AP50 class-agnostic"),
    ("AP75_agnostic", "AP75 class-agnostic"),
    ("AR100_agnostic", "AR100 class-agnostic"),
    ("f1_box", "F1 box-only (= f1)"),
    ("f1_desc", "F1 desc-aware (a hit needs the right desc)"),
    ("precision_desc", "precision desc-aware"),
    ("recall_desc", "recall desc-aware"),
    ("desc_accuracy", "desc accuracy on matched pairs"),
    ("pred_desc_top_share", "share of the most common predicted desc"),
    ("gt_desc_top_share", "share of the most common ground-truth desc"),
)


EVAL_CONVENTIONS = (
    "AP / AR are COCOeval's bbox numbers, class-aware unless marked class-agnostic: AP is the mean over IoU "
    ".50:.95 and 101 recall points at 100 detections per image and category; APs / APm / APl by area < 32², "
    "32²–96², > 96² px; -1: nothing to measure. Precision / recall / F1 are box-only at IoU 0.5 "
    "(docs/evaluation.md)."
)


def eval_rows(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    """The metrics table of one `stagectl eval` run (report.md and report.html)."""
    rows = [(name, fmt(metrics.get(name))) for name in EVAL_SHOWN]
    rows += [(label, fmt(metrics[key])) for key, label in EVAL_LABEL_SHOWN if key in metrics]
    rows += [
        ("images evaluated", _images_evaluated(metrics)),
        ("invalid rollouts (rate)", fmt(metrics.get("invalid_rate"))),
        ("duplicate predictions (rate)", fmt(metrics.get("dup_rate"))),
        ("predictions of unknown categories", fmt(metrics.get("n_unknown_category"))),
        ("throughput", f"{fmt(metrics.get('images_per_s'))} images/s"),
    ]
    return rows


def _images_evaluated(metrics: dict[str, Any]) -> str:
    """`64 of 5000 (...)` when `data.eval.max_samples` cut the split: an AP on 64 images is not val2017's."""
    num_images, num_available = metrics.get("n_images"), metrics.get("num_available")
    if isinstance(num_images, int) and isinstance(num_available, int) and num_available > num_images:
        return f"{num_images} of {num_available} (the first ones: data.eval.max_samples)"
    return fmt(num_images)


def per_class_rows(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    per_class = metrics.get("per_class_ap") or {}
    return [(_cell(str(name)), fmt(ap)) for name, ap in sorted(per_class.items())]


def score_rows(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    """The AP each score kind gives (`AP_by_score`, `constant`: every score 1); empty for older evals."""
    return [(f"`{kind}`", fmt(ap)) for kind, ap in (metrics.get("AP_by_score") or {}).items()]


def desc_rows(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    """The most common predicted descs with their counts and shares; empty for older evals."""
    num_pred = metrics.get("n_pred") or 0
    return [
        (_cell(str(desc)), f"{count} ({count / num_pred:.1%})" if num_pred else str(count))
        for desc, count in metrics.get("pred_desc_top") or []
    ]


def render_eval(
    title: str,
    subtitle: str,
    metrics: dict[str, Any],
    figures: Figures,
    plot_dir: str,
    notes: Sequence[str] = (),
) -> str:
    """The report of one `stagectl eval` run: its metrics (box vs label), the AP of every score kind, the
    predicted-desc histogram, the per-class AP table, the PR curve."""
    lines = [
        f"# {title}",
        "",
        subtitle,
        "",
        "## Metrics",
        "",
        EVAL_CONVENTIONS,
        "",
        *table(eval_rows(metrics)),
    ]
    if score_rows(metrics):
        lines += ["", f"## AP by score (used: `{metrics.get('score')}`; `constant`: every score 1)", ""]
        lines += table(score_rows(metrics), ("score", "AP"))
    if desc_rows(metrics):
        shown, distinct = len(desc_rows(metrics)), fmt(metrics.get("num_pred_descs"))
        lines += ["", f"## Predicted descs (the {shown} most common of {distinct})", ""]
        lines += table(desc_rows(metrics), ("desc", "predictions"))
    lines += ["", "## AP per class (IoU .50:.95; -1: no ground truth of it)", ""]
    lines += table(per_class_rows(metrics), ("class", "AP"))
    lines += _figures(figures, plot_dir) + _notes(notes)
    return "\n".join(lines) + "\n"


def stage_b_rows(s: StageBSummary) -> list[tuple[str, str]]:
    return [
        (
            "tickets judged",
            f"{s.num_tickets} ({s.num_batches} global batches, {s.num_windows} logging windows)",
        ),
        ("epochs", str(s.num_epochs)),
        ("accuracy: first / last window", f"{fmt(s.accuracy_first)} / {fmt(s.accuracy_last)}"),
        ("accuracy over all tickets", fmt(s.accuracy_overall)),
        ("false pass (fail judged pass): count / rate", f"{s.num_fp} / {fmt(s.fp_rate)}"),
        ("false fail (pass judged fail): count / rate", f"{s.num_fn} / {fmt(s.fn_rate)}"),
        ("tickets without a verdict", str(s.num_no_verdict)),
        ("malformed candidates", f"{s.num_malformed} of {s.num_candidates}"),
        ("guidance step: first / last", f"{fmt(s.guidance_step_first)} / {fmt(s.guidance_step_last)}"),
        ("reflections: run / changed guidance", f"{s.num_reflections} / {s.num_guidance_changes}"),
        ("guidance operations: accepted / dropped", f"{s.num_ops_accepted} / {s.num_ops_dropped}"),
        ("throughput", f"{fmt(s.tickets_per_s, 5)} tickets/s (tickets / summed window time)"),
    ]


def render_stage_b(
    title: str, subtitle: str, summary: StageBSummary, figures: Figures, plot_dir: str, notes: Sequence[str]
) -> str:
    lines = [f"# {title}", "", subtitle, "", "## Summary", ""]
    lines += table(stage_b_rows(summary))
    lines += ["", "## Guidance now (`guidance.json`)", ""]
    if summary.experiences:
        lines += ["| key | experience |", "|---|---|"]
        lines += [f"| {key} | {_cell(text)} |" for key, text in summary.experiences.items()]
    else:
        lines.append("No `guidance.json` experiences found.")
    lines += _figures(figures, plot_dir) + _notes(notes)
    return "\n".join(lines) + "\n"


def render_index(title: str, rows: Sequence[tuple[str, str, str]]) -> str:
    """A parent dir's report.md: (mission, one-line summary, link to its report.md)."""
    lines = [f"# {title}", "", "| mission | summary | report |", "|---|---|---|"]
    lines += [f"| {mission} | {summary} | [{link}]({link}) |" for mission, summary, link in rows]
    return "\n".join(lines) + "\n"


def _figures(figures: Figures, plot_dir: str) -> list[str]:
    lines = ["", "## Plots", ""]
    for plot in figures.plots:
        lines += [f"### {plot.title}", "", f"![{plot.title}]({plot_dir}/{plot.file})", "", plot.caption, ""]
    if not figures.plots:
        lines += ["No plots could be drawn.", ""]
    if figures.skipped:
        lines += ["## Not plotted", ""]
        lines += [f"- {item.what}: {item.reason}." for item in figures.skipped]
        lines.append("")
    return lines


def _notes(notes: Sequence[str]) -> list[str]:
    return ["## Notes", "", *[f"- {n}" for n in notes]] if notes else []


def _cell(text: str) -> str:
    one_line = " ".join(text.split()).replace("|", "\\|")
    if len(one_line) > MAX_EXPERIENCE_CHARS:
        return one_line[: MAX_EXPERIENCE_CHARS - 1] + "…"
    return one_line
