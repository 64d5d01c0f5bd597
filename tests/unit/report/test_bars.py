"""Bar plots of long runs: a bar a step (or an epoch) took minutes in matplotlib for a 5,000-step run
(`stagectl report` printed nothing meanwhile) and drew bars thinner than a pixel; the bars are now the
means of consecutive groups, at most `MAX_BARS` a panel, and the title says what a bar is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import stagectl.report.plots_phases as plots_phases
import stagectl.report.plots_samples as plots_samples
from stagectl.report.plotting import MAX_BARS, bars
from stagectl.timing import PHASES, phase_key


def test_bars_group_consecutive_entries_and_average_them() -> None:
    few = bars([1.0, 2.0, 3.0])
    assert (few.x, few.width, few.size, few.note("steps")) == ([1.0, 2.0, 3.0], 0.85, 1, "")
    xs = [float(s) for s in range(1, 1001)]
    many = bars(xs)
    assert many.size == 5 and len(many.x) == MAX_BARS and many.x[0] == 3.0
    assert many.means(xs)[:2] == [3.0, 8.0] and many.width == pytest.approx(0.9 * 5)
    assert many.note("steps") == " (one bar: the mean of 5 steps)"
    odd = bars([float(s) for s in range(1001)])  # 201 groups would be one too many: groups of 6
    assert len(odd.x) <= MAX_BARS and sum(len(g) for g in odd.groups) == 1001


def _drawn(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[Any]:
    figures: list[Any] = []
    monkeypatch.setattr(module, "save", lambda fig, path: figures.append(fig))
    return figures


def test_a_long_runs_phase_and_sample_plots_draw_at_most_max_bars_a_series(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    steps = 1000
    rows = [{"step": s, "time/step_s": 1.0, **{phase_key(p): 0.1 for p in PHASES}} for s in range(steps)]
    figures = _drawn(monkeypatch, plots_phases)
    plots_phases.phase_plot(rows, tmp_path)
    (ax,) = figures[0].axes
    series = len(PHASES) + 1  # every phase, and the rest
    assert len(ax.patches) == series * MAX_BARS and "the mean of 5 steps" in ax.get_title()
    assert max(p.get_y() + p.get_height() for p in ax.patches) == pytest.approx(1.0)  # a step's wall
    samples = [
        {"step": s, "channel": "B", "rank": 0, "stream_pos": 2 * s + k, "sample": (2 * s + k) % 3}
        | {"train_version": s, "gen_version": s - k}
        for s in range(steps)
        for k in range(2)
    ]
    figures = _drawn(monkeypatch, plots_samples)
    plots_samples.staleness_plot(samples, tmp_path)
    plots_samples.epochs_plot(samples, 3, 1, tmp_path)
    staleness, epochs = figures[0].axes[0], figures[1].axes[0]
    assert len(staleness.patches) == 2 * MAX_BARS  # two lags
    assert len(epochs.patches) <= MAX_BARS and len(epochs.get_xticks()) < 40  # 667 epochs
