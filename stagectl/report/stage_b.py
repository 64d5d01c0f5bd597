"""Summary of one Stage-B mission from its artifacts (pure): tickets, accuracy, false pass / false fail,
guidance steps and reflections.

Inputs are the rows of `metrics.jsonl` (one per logging window), `selections.jsonl` (one per
ticket), `reflection.jsonl` (one per reflection) and the parsed `guidance.json`. Per-ticket numbers
come from the selections when there are any (exact), else from the window rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagectl.report.values import Row, number, ratio
from stagectl.rundir.liveness import running_process


@dataclass
class StageBSummary:
    num_windows: int
    num_tickets: int
    num_batches: int
    num_epochs: int
    accuracy_first: float | None  # first logging window
    accuracy_last: float | None  # last logging window
    accuracy_overall: float | None
    num_fp: int  # labelled fail, judged pass (false pass)
    num_fn: int  # labelled pass, judged fail (false fail)
    fp_rate: float | None
    fn_rate: float | None
    num_no_verdict: int
    num_candidates: int
    num_malformed: int
    guidance_step_first: int | None
    guidance_step_last: int | None
    num_reflections: int
    num_guidance_changes: int
    num_ops_accepted: int
    num_ops_dropped: int
    tickets_per_s: float | None
    experiences: dict[str, str] = field(default_factory=dict)


def cumulative_tickets(metrics: Sequence[Row]) -> list[int]:
    """Tickets judged up to the end of each logging window: the x axis of the Stage-B plots."""
    out: list[int] = []
    total = 0
    for row in metrics:
        total += int(number(row, "num_tickets") or 0)
        out.append(total)
    return out


def guidance_step_by_ticket(selections: Sequence[Row]) -> tuple[list[int], list[int]]:
    """(ticket number, 1-based; guidance step the ticket was judged under)."""
    xs: list[int] = []
    ys: list[int] = []
    for n, row in enumerate(selections, start=1):
        step = number(row, "guidance_step")
        if step is not None:
            xs.append(n)
            ys.append(int(step))
    return xs, ys


def guidance_change_tickets(metrics: Sequence[Row]) -> list[int]:
    """Cumulative ticket counts at the end of the windows in which guidance changed."""
    return [
        x
        for x, row in zip(cumulative_tickets(metrics), metrics, strict=True)
        if (number(row, "num_guidance_changes") or 0) > 0
    ]


def summarize_stage_b(
    metrics: Sequence[Row],
    selections: Sequence[Row],
    reflections: Sequence[Row],
    guidance: dict[str, Any] | None,
) -> StageBSummary:
    if not metrics and not selections:
        raise ValueError("no Stage-B metrics or selections to summarise")
    accuracies = [a for row in metrics if (a := number(row, "accuracy")) is not None]
    elapsed_s = sum(number(row, "elapsed_s") or 0.0 for row in metrics)
    window_tickets = sum(int(number(row, "num_tickets") or 0) for row in metrics)
    num_tickets = len(selections) or window_tickets
    summary = StageBSummary(
        num_windows=len(metrics),
        num_tickets=num_tickets,
        num_batches=int(sum(number(row, "num_batches") or 0 for row in metrics)),
        num_epochs=1 + int(max((number(row, "epoch") or 0 for row in [*metrics, *selections]), default=0)),
        accuracy_first=accuracies[0] if accuracies else None,
        accuracy_last=accuracies[-1] if accuracies else None,
        accuracy_overall=None,
        num_fp=0,
        num_fn=0,
        fp_rate=None,
        fn_rate=None,
        num_no_verdict=0,
        num_candidates=0,
        num_malformed=0,
        guidance_step_first=None,
        guidance_step_last=None,
        num_reflections=len(reflections),
        num_guidance_changes=sum(bool(row.get("changed")) for row in reflections),
        num_ops_accepted=sum(len(row.get("accepted") or []) for row in reflections),
        num_ops_dropped=sum(len(row.get("dropped") or []) for row in reflections),
        tickets_per_s=ratio(window_tickets, elapsed_s),
        experiences=_experiences(guidance),
    )
    if selections:
        _add_from_selections(summary, selections)
    else:
        _add_from_windows(summary, metrics)
    _add_guidance_steps(summary, metrics, selections, reflections)
    return summary


def _add_from_selections(summary: StageBSummary, selections: Sequence[Row]) -> None:
    fails = [row for row in selections if row.get("label") == "fail"]
    passes = [row for row in selections if row.get("label") == "pass"]
    summary.accuracy_overall = ratio(sum(bool(row.get("label_match")) for row in selections), len(selections))
    summary.num_fp = sum(row.get("verdict") == "pass" for row in fails)
    summary.num_fn = sum(row.get("verdict") == "fail" for row in passes)
    summary.fp_rate = ratio(summary.num_fp, len(fails))
    summary.fn_rate = ratio(summary.num_fn, len(passes))
    summary.num_no_verdict = sum(row.get("verdict") is None for row in selections)
    for row in selections:
        summary.num_malformed += int(number(row, "num_malformed") or 0)
        summary.num_candidates += int(
            sum(number(row, key) or 0 for key in ("num_pass", "num_fail", "num_malformed"))
        )


def _add_from_windows(summary: StageBSummary, metrics: Sequence[Row]) -> None:
    """Without selections: ticket-weighted window accuracy, summed fp/fn counts (rates unknown)."""
    correct = sum((number(row, "accuracy") or 0.0) * (number(row, "num_tickets") or 0) for row in metrics)
    summary.accuracy_overall = ratio(correct, summary.num_tickets)
    summary.num_fp = int(sum(number(row, "num_fp") or 0 for row in metrics))
    summary.num_fn = int(sum(number(row, "num_fn") or 0 for row in metrics))
    summary.num_no_verdict = int(sum(number(row, "num_no_verdict") or 0 for row in metrics))


def _add_guidance_steps(
    summary: StageBSummary, metrics: Sequence[Row], selections: Sequence[Row], reflections: Sequence[Row]
) -> None:
    """First: the step the first ticket was judged under; last: after the last window or reflection."""
    firsts = [number(row, "guidance_step") for row in selections[:1]]
    firsts += [number(row, "guidance_step_before") for row in reflections[:1]]
    firsts += [number(row, "guidance_step") for row in metrics[:1]]  # end of window 0: a fallback
    lasts = [number(row, "guidance_step") for row in metrics[-1:]]
    lasts += [number(row, "guidance_step_after") for row in reflections[-1:]]
    first = [v for v in firsts if v is not None]
    last = [v for v in lasts if v is not None]
    summary.guidance_step_first = int(first[0]) if first else None
    summary.guidance_step_last = int(max(last)) if last else None


def _experiences(guidance: dict[str, Any] | None) -> dict[str, str]:
    experiences = guidance.get("experiences") if isinstance(guidance, dict) else None
    if not isinstance(experiences, dict):
        return {}
    return {str(key): str(text) for key, text in experiences.items()}


def progress_notes(progress: dict[str, Any] | None, mission_dir: str) -> list[str]:
    """What `progress.json` says a reader must know: a run that did not finish (stopped, failed and why, or
    killed), and ticket lines it skipped."""
    if not isinstance(progress, dict):
        return ["no `progress.json`: whether the run finished is unknown (a run of an older stagectl)."]
    notes = []
    status = progress.get("status")
    where = f"before global batch {progress.get('batch_index')} (epoch {progress.get('epoch')})"
    if status == "stopped":
        notes.append(
            f"the run did not finish: stopped by signal {progress.get('stopped_by_signal')} {where}; "
            f"`stagectl stage-b CONFIG --resume` continues it ({mission_dir})."
        )
    elif status == "failed":
        notes.append(
            f"the run did not finish: failed {where}: {progress.get('error')}; once the cause is fixed, "
            f"`stagectl stage-b CONFIG --resume` continues it from there ({mission_dir})."
        )
    elif status != "finished":
        proc = running_process(Path(mission_dir))  # `running.json`: rank 0's process, until the loop ends
        if proc is None:
            notes.append(
                f"the run did not finish (still running, or killed) {where}; `--resume` continues it."
            )
        elif proc.alive is False:
            notes.append(f"the run did not finish {where}: {proc.describe()}; `--resume` continues it.")
        else:
            notes.append(f"no end recorded yet ({where}): {proc.describe()}.")
    num_bad = progress.get("num_bad_ticket_lines")
    # not a number (a hand-edited file's "many"): no note, where int() ended the report with a ValueError
    if isinstance(num_bad, int) and num_bad > 0:
        lines = progress.get("bad_ticket_lines")
        first = "; ".join(str(line) for line in lines) if isinstance(lines, list) else ""
        notes.append(
            f"{num_bad} bad ticket line(s) skipped (`runner.bad_ticket_lines: skip`): the numbers cover the "
            f"other tickets only. First: {first}"
        )
    return notes
