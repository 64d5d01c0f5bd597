"""The plots of `samples.jsonl`: B staleness per step, samples trained per epoch. Each function draws one
file, or says why it cannot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from stagectl.report.plotting import (
    MAX_FULL_MARKS,
    bars,
    count_axis,
    label_axes,
    line_marker_size,
    new_figure,
    save,
)
from stagectl.report.samples import b_staleness, samples_per_epoch
from stagectl.report.sections import Plot, Skipped
from stagectl.report.values import Row

STEP = "optimizer step"


def staleness_plot(rows: Sequence[Row], out_dir: Path) -> Plot | Skipped:
    by_step = b_staleness(rows)
    if not by_step:
        return Skipped("B staleness per step", "no Channel-B sample in `samples.jsonl`")
    lags = sorted({lag for counts in by_step.values() for lag in counts})
    steps = list(by_step)
    per_bar = bars(steps, width=0.8)
    fig, (ax,) = new_figure(1, title="Channel-B staleness per step")
    bottom = [0.0] * len(per_bar.x)
    for lag in lags:
        heights = per_bar.means([by_step[s][lag] for s in steps])
        ax.bar(per_bar.x, heights, bottom=bottom, width=per_bar.width, label=f"{lag} version(s) old")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    count_axis(ax, bottom)
    title = "B samples trained per step, by train_version − gen_version (every rank)" + per_bar.note(
        "B steps"
    )
    label_axes(ax, title, STEP, "samples")
    name = "samples_staleness.png"
    save(fig, out_dir / name)
    return Plot(
        name,
        "B staleness per step",
        "From `samples.jsonl`: each B step's samples stacked by how many policy versions separate the "
        "weights that generated them from the weights that trained them.",
    )


def epochs_plot(
    rows: Sequence[Row], num_samples: int | None, world_size: int, out_dir: Path
) -> Plot | Skipped:
    if not rows:
        return Skipped("samples seen per epoch", "`samples.jsonl` is empty")
    if num_samples is None:
        return Skipped(
            "samples seen per epoch", "the data set size is unknown (no readable data in `config.yaml`)"
        )
    counts = samples_per_epoch(rows, num_samples, world_size)
    channels = sorted({c.channel for c in counts})
    fig, axes = new_figure(len(channels), ncols=len(channels), title="Samples trained per epoch")
    for ax, channel in zip(axes, channels, strict=True):
        mine = [c for c in counts if c.channel == channel]
        per_bar = bars([c.epoch for c in mine], width=0.8)
        trained = per_bar.means([c.trained for c in mine])
        ax.bar(per_bar.x, trained, width=per_bar.width, label="trained")
        distinct = per_bar.means([c.distinct for c in mine])
        ax.plot(
            per_bar.x,
            distinct,
            "o",
            markersize=line_marker_size(len(per_bar.x)),
            color="black",
            label="distinct samples",
        )
        ax.axhline(num_samples, color="gray", linestyle="--", linewidth=1, label=f"data set ({num_samples})")
        count_axis(ax, [num_samples, *trained])
        title = f"Channel-{channel}" + per_bar.note("epochs")
        label_axes(ax, title, "epoch of the stream", "samples", legend="inside")
        if len(mine) <= MAX_FULL_MARKS:  # a tick per epoch; thousands of labels took minutes to draw
            ax.set_xticks([c.epoch for c in mine])
    name = "samples_epochs.png"
    save(fig, out_dir / name)
    return Plot(
        name,
        "Samples seen per epoch",
        "From `samples.jsonl`: samples trained from each epoch of each channel's stream (every rank); a "
        "finished epoch trains every sample once (Channel-B: less what was dropped).",
    )
