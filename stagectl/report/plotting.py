"""Matplotlib plumbing shared by the plot modules: figures on the Agg canvas (no pyplot, no GUI,
no global backend state), labelled axes, vertical step markers, saving.

Only the plot modules import this, and only `stagectl report` imports them, so matplotlib never
loads for any other command.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

DPI = 110
PANEL_WIDTH_IN = 6.0
PANEL_HEIGHT_IN = 3.4
B_COLOR = "tab:orange"
SKIP_COLOR = "tab:red"
MAX_FULL_MARKS = 40
MAX_BARS = 200  # bars a panel draws at most (`bars`)


def new_figure(num_panels: int, ncols: int = 1, title: str = "") -> tuple[Figure, list[Axes]]:
    """A figure of `num_panels` axes in `ncols` columns (unused grid cells are hidden)."""
    nrows = -(-num_panels // ncols)
    width = PANEL_WIDTH_IN * ncols if ncols > 1 else 10.0
    fig = Figure(figsize=(width, PANEL_HEIGHT_IN * nrows + 0.4), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(nrows, ncols, squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[num_panels:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=13, fontweight="bold")
    return fig, axes[:num_panels]


def label_axes(
    ax: Axes, title: str, xlabel: str, ylabel: str, legend: Literal["outside", "inside", "none"] = "outside"
) -> None:
    """Title, axis labels, grid, integer x ticks (steps and tickets are counts) and the legend:
    outside the panel on the right by default, so it never hides data."""
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if legend == "none" or not ax.get_legend_handles_labels()[0]:
        return
    if legend == "outside":
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.85)
    else:
        ax.legend(fontsize=8, loc="best", framealpha=0.85)


def count_axis(ax: Axes, values: Sequence[float]) -> None:
    """A y axis for counts: starts at 0, integer ticks, a visible range even when all values are 0."""
    top = max([*values, 1.0])
    ax.set_ylim(-0.04 * top, top * 1.08)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def fraction_axis(ax: Axes) -> None:
    """A y axis for rates and scores in [0, 1]."""
    ax.set_ylim(-0.02, 1.02)


def mark_x(ax: Axes, xs: Sequence[float], label: str, color: str = SKIP_COLOR) -> None:
    """Vertical marks at `xs` with one legend entry: dashed full-height lines when there are few,
    a rug of short ticks along the bottom when there are many (full lines would hide the data)."""
    if not xs:
        return
    if len(xs) <= MAX_FULL_MARKS:
        ax.vlines(
            list(xs), 0, 1, transform=ax.get_xaxis_transform(), colors=color,
            linestyles="--", linewidth=1.0, alpha=0.6, label=label,
        )  # fmt: skip
    else:
        ax.vlines(
            list(xs), 0, 0.05, transform=ax.get_xaxis_transform(), colors=color,
            linewidth=0.8, alpha=0.8, label=f"{label} (ticks at the bottom)",
        )  # fmt: skip


@dataclass(frozen=True)
class Bars:
    """Consecutive entries grouped so that a bar plot draws at most `MAX_BARS` bars (one a step over a run of
    5,000 steps took minutes in matplotlib and drew bars thinner than a pixel): a bar is one group's mean."""

    groups: list[range]  # positions into the values, consecutive
    x: list[float]  # each bar's place: its group's mean x
    width: float  # in x units

    @property
    def size(self) -> int:
        return len(self.groups[0]) if self.groups else 1

    def means(self, values: Sequence[float]) -> list[float]:
        return [sum(values[i] for i in g) / len(g) for g in self.groups]

    def note(self, unit: str) -> str:
        """What one bar is, for a title: "" when each bar is one entry."""
        return "" if self.size == 1 else f" (one bar: the mean of {self.size} {unit})"


def bars(xs: Sequence[float], width: float = 0.85) -> Bars:
    """`xs` (ascending) as `Bars`: one per entry up to `MAX_BARS`, else groups of as many entries as needed;
    `width`: a bar's width for one entry of the typical spacing."""
    size = max(1, -(-len(xs) // MAX_BARS))
    groups = [range(k, min(k + size, len(xs))) for k in range(0, len(xs), size)]
    spacing = (xs[-1] - xs[0]) / (len(xs) - 1) if len(xs) > 1 else 1.0
    centres = [sum(xs[i] for i in g) / len(g) for g in groups]
    return Bars(groups, centres, width if size == 1 else 0.9 * size * spacing)


def point_size(num_points: int) -> float:
    """Marker area for a scatter of `num_points`: big enough to see, small enough not to merge."""
    return 22.0 if num_points <= 100 else 8.0 if num_points <= 1000 else 2.0


def line_marker_size(num_points: int) -> float:
    """Markers on a line plot: visible for a few points, none for thousands (the line says it all)."""
    return 4.5 if num_points <= 100 else 1.5 if num_points <= 1000 else 0.0


def note_empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="0.4")


def save(fig: Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
