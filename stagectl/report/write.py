"""`stagectl report` end to end: find the runs under RUN_DIR, read their files, draw the plots into
`report/` and write `report.md` next to it. The only module here that reads and writes files.

train-ab: `RUN_DIR/report.md` + `RUN_DIR/report/*.png`. Stage-B: the same inside every mission dir,
plus an index `RUN_DIR/report.md` when RUN_DIR is a parent of mission dirs.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from stagectl.files import atomic_write_text, check_output_dir, make_staging_dir
from stagectl.report import html
from stagectl.report.detect import EVAL_METRICS, METRICS, Run, find_runs
from stagectl.report.jsonl import read_jsonl
from stagectl.report.markdown import (
    eval_rows,
    fmt,
    per_class_rows,
    render_eval,
    render_index,
    render_stage_b,
    render_train_ab,
    stage_b_rows,
    train_ab_rows,
)
from stagectl.report.plots_samples import epochs_plot, staleness_plot
from stagectl.report.plots_stage_b import write_stage_b_plots
from stagectl.report.plots_train_ab import pr_curve_plot, write_train_ab_plots
from stagectl.report.sections import Figures, Skipped
from stagectl.report.stage_b import progress_notes, summarize_stage_b
from stagectl.report.train_ab import (
    config_value,
    last_run,
    step_rows,
    summarize_eval,
    summarize_train_ab,
    target_b_ratio,
)
from stagectl.rundir.ending import FINAL_STATE, RunEnd, go_on_note, run_end
from stagectl.rundir.liveness import running_process

REPORT_MD = "report.md"
SAMPLES = "samples.jsonl"
PLOT_DIR = "report"


@dataclass
class Written:
    report: Path
    num_plots: int = 0
    not_plotted: list[str] = field(default_factory=list)
    html: Path | None = None  # report.html beside report.md
    notes: list[str] = field(default_factory=list)  # the report's notes (what it skipped or could not know)


def write_reports(run_dir: Path) -> list[Written]:
    """Write the report(s) for `run_dir`; ValueError (one line) when there is nothing to report, or before
    anything is drawn when a report could not be written whole (`check_report_paths`)."""
    runs = find_runs(run_dir)
    for run in runs:
        check_report_paths(run.path)
    if len(runs) > 1 or runs[0].path != run_dir:  # a parent of Stage-B missions gets an index report.md
        check_report_paths(run_dir)
    if runs[0].kind == "train_ab":
        return [write_train_ab_report(runs[0].path)]
    if runs[0].kind == "eval":
        return [write_eval_report(runs[0].path)]
    if runs == [Run("stage_b", run_dir)]:
        return [write_stage_b_report(run_dir)]
    return _write_stage_b_reports(run_dir, [run.path for run in runs])


def write_train_ab_report(run_dir: Path) -> Written:
    metrics = read_jsonl(run_dir / METRICS)
    rows, num_earlier = last_run(step_rows(metrics.rows))
    if not rows:
        raise ValueError(f"no metrics rows in {run_dir / METRICS}")
    notes = metrics.notes()
    if num_earlier:
        notes.append(
            f"`{METRICS}` holds more than one run: this report covers the last one "
            f"({num_earlier} earlier rows left out)."
        )
    config, config_notes = _read_config(run_dir / "config.yaml")
    notes += config_notes
    target = target_b_ratio(config)
    if target is None:
        notes.append("target B ratio unknown: no `stage2_ab.schedule.b_ratio` in `config.yaml`.")
    eval_file = read_jsonl(run_dir / "eval.jsonl")
    notes += eval_file.notes()
    summary = summarize_train_ab(rows, target)
    max_steps = config_value(config, "training.max_steps")
    final_state, final_notes = _read_json(run_dir / FINAL_STATE)
    notes += final_notes
    end = _run_end(final_state, max_steps)
    if end is not None and not end.finished:  # an error or a signal ended it (or max_steps was raised since)
        notes.append(f"the run did not finish: {end.describe()}; {go_on_note(run_dir)}.")
    elif isinstance(max_steps, int) and summary.last_step + 1 < max_steps:
        notes.append(
            f"partial run: the last logged step is {summary.last_step} of `training.max_steps` = {max_steps}."
        )
    if not (run_dir / FINAL_STATE).is_file():
        proc = running_process(run_dir)  # `running.json`: rank 0's process, until the run ends
        if proc is None:
            notes.append(f"no `{FINAL_STATE}`: the run did not finish (or is still running).")
        elif proc.alive is False:
            notes.append(
                f"no `{FINAL_STATE}`: the run did not finish; {proc.describe()}; {go_on_note(run_dir)}."
            )
        else:
            notes.append(f"no `{FINAL_STATE}` yet: {'the run is ' if proc.alive else ''}{proc.describe()}.")
    if final_state is not None and isinstance(final_state.get("b_steps"), dict):
        summary.b_steps = final_state["b_steps"]
    with _staged_plot_dir(run_dir) as plot_dir:  # the earlier report stays whole until this one is
        figures = write_train_ab_plots(rows, eval_file.rows, target, plot_dir)
        notes += _sample_plots(run_dir, config, figures, plot_dir)
        mode = config_value(config, "stage2_ab.channel_b.mode") or ("async" if summary.is_async else "step")
        ranks = config_value(config, "launch.nproc_per_node")
        subtitle = (
            f"train-ab run in `{run_dir}`: Channel-B mode `{mode}`"
            + (f", {ranks} rank(s) per node" if isinstance(ranks, int) else "")
            + f". Generated by `stagectl report` from `{METRICS}` ({summary.num_steps} rows)."
        )
        ev = summarize_eval(eval_file.rows)
        text = render_train_ab("train-ab run report", subtitle, summary, ev, figures, PLOT_DIR, notes)
        page = html.train_ab_page(
            run_dir,
            "train-ab run report",
            subtitle,
            train_ab_rows(summary, ev),
            summary.terms,
            rows,
            figures,
            PLOT_DIR,
            notes,
        )
        return _write(run_dir, text, figures, page, plot_dir)


def _run_end(final_state: dict[str, Any] | None, max_steps: Any) -> RunEnd | None:
    """How the run ended by its `final_state.json` (None: no file, or one without `global_step`)."""
    if final_state is None:
        return None
    try:
        return run_end(final_state, max_steps if isinstance(max_steps, int) else None)
    except ValueError:
        return None


def _sample_plots(
    run_dir: Path, config: dict[str, Any] | None, figures: Figures, plot_dir: Path
) -> list[str]:
    """The `samples.jsonl` plots (B staleness per step, samples per epoch); notes on what was skipped."""
    samples = read_jsonl(run_dir / SAMPLES)
    if not samples.path.is_file():
        figures.add(Skipped("per-sample plots", f"no `{SAMPLES}` (a run from before the audit trail)"))
        return []
    rows = [r for r in samples.rows if {"step", "channel", "rank", "sample", "stream_pos"} <= r.keys()]
    world_size = max((int(r["rank"]) for r in rows), default=0) + 1
    figures.add(staleness_plot(rows, plot_dir))
    figures.add(epochs_plot(rows, _num_samples(config), world_size, plot_dir))
    return samples.notes()


def _num_samples(config: dict[str, Any] | None) -> int | None:
    """The training set's size from the run's config: the synthetic count, or the JSONL's lines."""
    synthetic = config_value(config, "data.synthetic.num_samples")
    if isinstance(synthetic, int):
        return synthetic
    train_jsonl = config_value(config, "data.train_jsonl")
    if isinstance(train_jsonl, str) and Path(train_jsonl).is_file():
        with open(train_jsonl, encoding="utf-8", errors="replace") as handle:
            return sum(1 for line in handle if line.strip())
    return None


def write_eval_report(eval_dir: Path) -> Written:
    """`stagectl eval`'s output dir: report.md (metrics, per-class AP) and the precision-recall curve."""
    metrics, notes = _read_json(eval_dir / EVAL_METRICS)
    if metrics is None:
        raise ValueError(f"{eval_dir / EVAL_METRICS}: {notes[0] if notes else 'not a JSON object'}")
    with _staged_plot_dir(eval_dir) as plot_dir:
        figures = Figures()
        figures.add(pr_curve_plot(metrics, "Evaluation: precision-recall at IoU 0.5", plot_dir))
        source = metrics.get("server") or metrics.get("model")
        subtitle = (
            f"`stagectl eval` of `{source}` on `{metrics.get('data')}` in `{eval_dir}` "
            f"({metrics.get('world_size', 1)} rank(s), evaluator {metrics.get('evaluator')})."
        )
        per_class = html.Grid(
            "AP per class (IoU .50:.95; -1: no ground truth of it)", ("class", "AP"), per_class_rows(metrics)
        )
        # a server whose weights changed while it was evaluated (`evaluation.run.weights_changed_line`)
        changed = metrics.get("served_weights_changed")
        notes += [f"{changed}."] if isinstance(changed, str) else []
        page = html.eval_page(
            eval_dir, "Evaluation report", subtitle, eval_rows(metrics), per_class, figures, PLOT_DIR, notes
        )
        text = render_eval("Evaluation report", subtitle, metrics, figures, PLOT_DIR, notes)
        return _write(eval_dir, text, figures, page, plot_dir)


def write_stage_b_report(mission_dir: Path) -> Written:
    metrics = read_jsonl(mission_dir / METRICS)
    selections = read_jsonl(mission_dir / "selections.jsonl")
    reflections = read_jsonl(mission_dir / "reflection.jsonl")
    if not metrics.rows and not selections.rows:
        raise ValueError(f"no Stage-B metrics rows in {mission_dir / METRICS}")
    notes = metrics.notes() + selections.notes() + reflections.notes()
    guidance, guidance_notes = _read_json(mission_dir / "guidance.json")
    notes += guidance_notes
    progress, progress_read = _read_json(mission_dir / "progress.json")  # stage_b.progress's file
    notes += progress_read or progress_notes(progress, str(mission_dir))  # unreadable: that note, not "none"
    for name, what in (
        ("need_review_queue.jsonl", "tickets queued for manual review"),
        ("failure_malformed.jsonl", "malformed candidates logged"),
    ):
        num = len(read_jsonl(mission_dir / name).rows)
        if num:
            notes.append(f"{num} {what} (`{name}`).")
    summary = summarize_stage_b(metrics.rows, selections.rows, reflections.rows, guidance)
    with _staged_plot_dir(mission_dir) as plot_dir:
        figures = write_stage_b_plots(metrics.rows, selections.rows, plot_dir)
        config, _ = _read_config(mission_dir / "config.yaml")
        mission = config_value(config, "mission") or mission_dir.name
        subtitle = (
            f"Stage-B mission `{mission}` of run `{mission_dir.parent.name}` in `{mission_dir}`. "
            f"Generated by `stagectl report` from `{METRICS}` ({len(metrics.rows)} windows) and "
            f"`selections.jsonl` ({len(selections.rows)} tickets)."
        )
        text = render_stage_b(f"Stage-B report: {mission}", subtitle, summary, figures, PLOT_DIR, notes)
        page = html.page_from_figures(f"Stage-B report: {mission}", subtitle, figures, PLOT_DIR, notes)
        page.summary = stage_b_rows(summary)
        page.grids.append(
            html.Grid(
                "Guidance now (guidance.json)", ("key", "experience"), list(summary.experiences.items())
            )
        )
        page.guidance_versions = html.guidance_versions(mission_dir, reflections.rows)
        return _write(mission_dir, text, figures, page, plot_dir)


def _write_stage_b_reports(parent: Path, missions: list[Path]) -> list[Written]:
    written: list[Written] = []
    index: list[tuple[str, str, str]] = []
    errors: list[str] = []
    for mission_dir in missions:
        link = (mission_dir / REPORT_MD).relative_to(parent).as_posix()
        name = mission_dir.relative_to(parent).as_posix()
        try:
            result = write_stage_b_report(mission_dir)
        except ValueError as exc:
            errors.append(str(exc))
            index.append((name, f"no report: {exc}", "-"))
            continue
        written.append(result)
        index.append((name, _mission_line(mission_dir), link))
    if not written:
        raise ValueError(errors[0])
    index_path = parent / REPORT_MD
    atomic_write_text(index_path, render_index(f"Stage-B reports under {parent}", index))
    return [Written(index_path), *written]


def _mission_line(mission_dir: Path) -> str:
    metrics = read_jsonl(mission_dir / METRICS).rows
    selections = read_jsonl(mission_dir / "selections.jsonl").rows
    s = summarize_stage_b(metrics, selections, read_jsonl(mission_dir / "reflection.jsonl").rows, None)
    return (
        f"{s.num_tickets} tickets, accuracy {fmt(s.accuracy_first)} → {fmt(s.accuracy_last)}, "
        f"guidance step {fmt(s.guidance_step_first)} → {fmt(s.guidance_step_last)}"
    )


def check_report_paths(report_dir: Path) -> None:
    """`ValueError` naming the path when `report_dir`'s report cannot be written: `report/` (the plots) a
    file, `report.md` or `report.html` a directory, or the directory not writable. Checked before the plots
    are drawn (seconds to minutes on a long run), which would otherwise be left behind without a report."""
    for name, is_dir in ((PLOT_DIR, True), (REPORT_MD, False), (html.REPORT_HTML, False)):
        path = report_dir / name
        if path.exists() and path.is_dir() != is_dir:
            what = "a file, not the directory of the plots" if is_dir else "a directory, not a file"
            raise ValueError(
                f"cannot write the report: {path} is {what}; move it away and run the report again"
            )
    check_output_dir(report_dir / PLOT_DIR, key="report")


@contextmanager
def _staged_plot_dir(run_dir: Path) -> Iterator[Path]:
    """A new directory under `run_dir/report/` to draw this report's plots into; `_write` moves them into
    `report/` once the report is drawn whole. Removed at the end either way, so a report that fails or is
    stopped (Ctrl-C) midway leaves the earlier report and every plot it links as they were."""
    out = run_dir / PLOT_DIR
    out.mkdir(parents=True, exist_ok=True)
    staging = make_staging_dir(out, ".drawing-")  # and a killed report's removed (SIGKILL: no `finally`)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # empty after `_write`; a failed report's plots


def _write(run_dir: Path, text: str, figures: Figures, page: html.Page, staging: Path) -> Written:
    """The plots drawn into `staging` moved into `report/`, then report.html and report.md (each replaced
    whole), then an earlier report's plots this one does not draw removed: at every moment report.md and
    report.html link only plots that are there."""
    plot_dir = run_dir / PLOT_DIR
    drawn = {png.name for png in staging.glob("*.png")}
    for name in sorted(drawn):
        os.replace(staging / name, plot_dir / name)
    page_path = html.write_html(run_dir, page)
    path = run_dir / REPORT_MD
    atomic_write_text(path, text)
    for old in plot_dir.glob("*.png"):  # a plot that no longer applies (e.g. no eval rows now)
        if old.name not in drawn:
            old.unlink()
    return Written(
        path, len(figures.plots), [item.what for item in figures.skipped], page_path, list(page.notes)
    )


def _read_config(path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    if not path.is_file():
        return None, [f"no `{path.name}` in the run dir."]
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        return None, [f"`{path.name}` is not valid YAML ({type(exc).__name__}); config values unknown."]
    return (loaded if isinstance(loaded, dict) else None), []


def _read_json(path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    if not path.is_file():
        return None, []
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        return None, [f"`{path.name}` is not valid JSON ({exc.msg}, line {exc.lineno})."]
    except (OSError, ValueError, RecursionError) as exc:  # not UTF-8, unreadable, nested too deeply
        return None, [f"`{path.name}` cannot be read ({str(exc) or type(exc).__name__})."]
    if not isinstance(loaded, dict):
        return None, [f"`{path.name}` is not a JSON object (it holds a {type(loaded).__name__})."]
    return loaded, []
