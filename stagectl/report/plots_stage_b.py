"""The PNG plots of one Stage-B mission: accuracy / false pass / false fail per logging window, and
the guidance step over the tickets judged."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.ticker import MaxNLocator

from stagectl.report.plotting import fraction_axis, label_axes, line_marker_size, mark_x, new_figure, save
from stagectl.report.sections import Figures, Plot, Skipped
from stagectl.report.stage_b import cumulative_tickets, guidance_change_tickets, guidance_step_by_ticket
from stagectl.report.values import Row, number

TICKETS = "tickets judged (cumulative)"
CHANGE_LABEL = "guidance changed (end of window)"


def write_stage_b_plots(metrics: Sequence[Row], selections: Sequence[Row], out_dir: Path) -> Figures:
    figures = Figures()
    figures.add(accuracy_plot(metrics, out_dir))
    figures.add(guidance_plot(metrics, selections, out_dir))
    return figures


def accuracy_plot(metrics: Sequence[Row], out_dir: Path) -> Plot | Skipped:
    if not any(number(row, "accuracy") is not None for row in metrics):
        return Skipped("accuracy / fp / fn", "no logging window with an `accuracy` in metrics.jsonl")
    xs = cumulative_tickets(metrics)
    fig, (ax,) = new_figure(1, title="Stage-B verdict quality per logging window")
    for key, label, marker in (
        ("accuracy", "accuracy (verdict = label)", "o"),
        ("fp_rate", "false-pass rate (fail tickets judged pass)", "v"),
        ("fn_rate", "false-fail rate (pass tickets judged fail)", "^"),
    ):
        points = [(x, v) for x, row in zip(xs, metrics, strict=True) if (v := number(row, key)) is not None]
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker=marker,
            markersize=line_marker_size(len(points)),
            label=label,
        )
    mark_x(ax, guidance_change_tickets(metrics), CHANGE_LABEL, color="tab:gray")
    fraction_axis(ax)
    label_axes(ax, "accuracy, false-pass and false-fail rates", TICKETS, "rate (0–1)")
    name = "accuracy.png"
    save(fig, out_dir / name)
    return Plot(
        name, "Accuracy, fp and fn rates", "One point per logging window, at the tickets judged so far."
    )


def guidance_plot(metrics: Sequence[Row], selections: Sequence[Row], out_dir: Path) -> Plot | Skipped:
    xs, steps = guidance_step_by_ticket(selections)
    source = "the step each ticket was judged under (selections.jsonl)"
    if not steps:
        window_x = cumulative_tickets(metrics)
        points = [
            (x, int(v))
            for x, r in zip(window_x, metrics, strict=True)
            if (v := number(r, "guidance_step")) is not None
        ]
        xs, steps = [p[0] for p in points], [p[1] for p in points]
        source = "the step at the end of each logging window (metrics.jsonl)"
    if not steps:
        return Skipped("guidance step", "no `guidance_step` in selections.jsonl or metrics.jsonl")
    fig, (ax,) = new_figure(1, title="Stage-B guidance step over time")
    ax.step(
        xs,
        steps,
        where="post",
        color="tab:purple",
        linewidth=1.8,
        marker="o",
        markersize=line_marker_size(len(xs)),
        label="guidance step",
    )
    mark_x(ax, guidance_change_tickets(metrics), CHANGE_LABEL, color="tab:gray")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    label_axes(ax, f"guidance step: {source}", TICKETS, "guidance step (accepted changes)")
    name = "guidance_step.png"
    save(fig, out_dir / name)
    return Plot(name, "Guidance step", "Each accepted reflection bumps the guidance step.")
