"""The learner's phases per step (`time/<phase>_s` of `stagectl.timing`) as stacked bars: where
each step's wall time went, and how much of it the learner spent waiting."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from stagectl.report.plotting import bars, label_axes, new_figure, save
from stagectl.report.sections import Plot, Skipped
from stagectl.report.values import Row, number
from stagectl.timing import PHASES, phase_key

LABELS = {
    "wait_packs": "waiting for rollouts / packs",
    "collate": "parse, match, pack, collate (learner thread)",
    "forward_backward": "forward / backward",
    "optimizer": "optimizer step",
    "fence": "weight sync: fence (rollouts in flight)",
    "weight_sync": "weight sync: push",
}
COLORS = {
    "wait_packs": "tab:purple",
    "collate": "tab:olive",
    "forward_backward": "tab:blue",
    "optimizer": "tab:cyan",
    "fence": "tab:red",
    "weight_sync": "tab:orange",
}


def phase_plot(rows: Sequence[Row], out_dir: Path) -> Plot | Skipped:
    timed = [
        r
        for r in rows
        if number(r, "time/step_s") is not None and number(r, phase_key("forward_backward")) is not None
    ]
    if not timed:
        return Skipped(
            "learner phases per step", f"no `{phase_key('forward_backward')}` in metrics.jsonl (an older run)"
        )
    per_bar = bars([number(r, "step") or 0.0 for r in timed])
    fig, (ax,) = new_figure(1, title="Where the learner's step time goes")
    bottom = [0.0] * len(per_bar.x)
    for phase in PHASES:
        values = [number(r, phase_key(phase)) or 0.0 for r in timed]
        if any(values):
            heights = per_bar.means(values)
            ax.bar(per_bar.x, heights, per_bar.width, bottom=bottom, color=COLORS[phase], label=LABELS[phase])
            bottom = [b + v for b, v in zip(bottom, heights, strict=True)]
    walls = per_bar.means([number(r, "time/step_s") or 0.0 for r in timed])
    other = [max(0.0, wall - b) for wall, b in zip(walls, bottom, strict=True)]
    ax.bar(
        per_bar.x,
        other,
        per_bar.width,
        bottom=bottom,
        color="lightgray",
        label="other (gates, metrics, eval)",
    )
    ax.set_ylim(bottom=0)
    title = "learner wall time per optimizer step, by phase (rank 0)" + per_bar.note("steps")
    label_axes(ax, title, "optimizer step", "seconds")
    name = "phases.png"
    save(fig, out_dir / name)
    return Plot(
        name,
        "Learner phases per step",
        "Each step's wall time split into the learner's phases (`time/<phase>_s`); the gray rest is bookkeeping.",
    )
