"""`stagectl report` pure cores: JSONL tolerance, run detection, train-ab and Stage-B summaries, markdown."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from stagectl.report.detect import find_runs
from stagectl.report.jsonl import parse_jsonl
from stagectl.report.markdown import fmt, fmt_ratio, render_train_ab
from stagectl.report.sections import Figures, Plot, Skipped
from stagectl.report.stage_b import cumulative_tickets, guidance_change_tickets, summarize_stage_b
from stagectl.report.train_ab import (
    is_skip_to_a,
    last_run,
    loss_terms,
    realised_b_ratio,
    summarize_eval,
    summarize_train_ab,
    target_b_ratio,
)
from stagectl.report.values import number, series
from stagectl.schedule import channel_for_step

ASYNC = "stage2_ab/async/"


def ab_row(step: int, kind: str = "A", **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "step": step,
        "kind": kind,
        "policy_wants_b": kind == "B",
        "loss": 10.0 - step,
        "loss/ce": 8.0 - step,
        "loss/bbox_ciou": 1.5,
        "tokens": 1000,
        "time/step_s": 0.5 if kind == "A" else 2.0,
        "time/wait_s": 0.0,
    }
    if kind == "B":
        row.update(
            {"rollout/precision": 0.1 * step, "rollout/recall": 0.05 * step, "rollout/f1": 0.07 * step}
        )
    row.update(extra)
    return row


# --------------------------------------------------------------------------- jsonl + values


def test_parse_jsonl_skips_torn_last_line_and_says_so() -> None:
    text = '{"step": 0}\n\n{"step": 1}\n{"step": 2, "lo'
    result = parse_jsonl(text, Path("metrics.jsonl"))
    assert [r["step"] for r in result.rows] == [0, 1]
    assert result.bad_lines == [4]
    (note,) = result.notes()
    assert "torn last line" in note and "4" in note


def test_parse_jsonl_reports_bad_middle_lines_and_non_objects() -> None:
    result = parse_jsonl('{"step": 0}\nnot json\n[1, 2]\n{"step": 1}\n', Path("m.jsonl"))
    assert [r["step"] for r in result.rows] == [0, 1]
    assert result.bad_lines == [2, 3]
    assert "torn" not in result.notes()[0]


@pytest.mark.parametrize("value", [None, True, "x", float("nan"), float("inf")])
def test_number_rejects_non_numbers(value: Any) -> None:
    assert number({"k": value}, "k") is None
    assert number({}, "k") is None


def test_series_drops_rows_without_the_key() -> None:
    rows: list[dict[str, Any]] = [
        {"step": 0, "f": 0.1},
        {"step": 1},
        {"step": 2, "f": None},
        {"step": 3, "f": 0.4},
    ]
    assert series(rows, "f") == ([0.0, 3.0], [0.1, 0.4])


# --------------------------------------------------------------------------- train-ab


def test_last_run_keeps_rows_after_the_last_restart() -> None:
    rows = [ab_row(s) for s in (0, 1, 2, 0, 1)]
    kept, earlier = last_run(rows)
    assert [r["step"] for r in kept] == [0, 1] and earlier == 3
    assert last_run(rows[:3]) == (rows[:3], 0)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"stage2_ab": {"schedule": {"b_ratio": 0.25}}}, Fraction(1, 4)),
        ({"stage2_ab": {"schedule": {"b_ratio": "1/3"}}}, Fraction(1, 3)),
        ({"stage2_ab": {"schedule": {"b_ratio": 0.7}}}, Fraction(7, 10)),
        ({"stage2_ab": {"schedule": {}}}, None),
        ({"stage2_ab": {"schedule": {"b_ratio": "one third"}}}, None),
        ({"stage2_ab": "oops"}, None),
        (None, None),
    ],
)
def test_target_b_ratio(config: Any, expected: Fraction | None) -> None:
    assert target_b_ratio(config) == expected


def test_summary_of_a_step_mode_run_follows_the_schedule() -> None:
    rows = [ab_row(s, channel_for_step(s, "1/3")) for s in range(9)]
    s = summarize_train_ab(rows, Fraction(1, 3))
    assert (s.num_steps, s.first_step, s.last_step) == (9, 0, 8)
    assert (s.num_a, s.num_b, s.num_wanted_b) == (6, 3, 3)
    assert s.realised_b_ratio == pytest.approx(1 / 3)
    assert s.skip_steps == [] and not s.is_async
    assert s.f1_last is not None and (s.f1_last.step, s.f1_last.value) == (8, pytest.approx(0.56))
    assert s.f1_best == s.f1_last
    assert s.tokens_total == 9000
    assert s.tokens_per_s == pytest.approx(9000 / (6 * 0.5 + 3 * 2.0))
    assert (s.mean_step_s_a, s.mean_step_s_b) == (0.5, 2.0)
    assert s.drop_stale_total is None and s.ver_lag_mean is None
    terms = {t.term: t for t in s.terms}
    assert list(terms) == ["loss", "loss/bbox_ciou", "loss/ce"]
    assert (terms["loss/ce"].first, terms["loss/ce"].last, terms["loss/ce"].min) == (8.0, 0.0, 0.0)


def test_summary_and_markdown_show_the_channel_b_pack_fill() -> None:
    """`packing/b_fill` of the B steps: its mean and its lowest step in the summary and in report.md;
    a run that never logged it (an older run, or no B step) shows no such row."""
    rows = [
        ab_row(0),
        ab_row(1, "B", **{"packing/b_fill": 0.95}),
        ab_row(2),
        ab_row(3, "B", **{"packing/b_fill": 0.85}),
    ]
    s = summarize_train_ab(rows, Fraction(1, 2))
    assert s.b_fill_mean == pytest.approx(0.9) and (s.b_fill_min, s.b_fill_min_step) == (0.85, 3)
    md = render_train_ab("t", "s", s, None, Figures([]), "plots", [])
    assert "| Channel-B pack fill (`packing/b_fill`): mean / min | 0.9 / 0.85 (step 3) |" in md
    older = summarize_train_ab([ab_row(0), ab_row(1, "B")], Fraction(1, 2))
    assert older.b_fill_mean is None
    assert "Channel-B pack fill" not in render_train_ab("t", "s", older, None, Figures([]), "plots", [])


def test_summary_of_an_async_run_counts_skips_drops_and_lag() -> None:
    rows = []
    for step in range(6):
        wanted = step % 2 == 1
        skipped = step == 1
        kind = "B" if wanted and not skipped else "A"
        extra = {
            "policy_wants_b": wanted,
            ASYNC + "policy_wants_b": int(wanted),
            ASYNC + "b_step_skipped_due_to_queue": int(skipped),
            ASYNC + "queue_depth": 4,
            ASYNC + "drop_stale_total": step // 2,
            ASYNC + "drop_oldest_total": 1 if step >= 4 else 0,
            ASYNC + "sync_total": step + 1,
        }
        if kind == "B":
            extra[ASYNC + "ver_lag"] = step // 2
        rows.append(ab_row(step, kind, **extra))
    s = summarize_train_ab(rows, Fraction(1, 2))
    assert s.is_async
    assert s.skip_steps == [1]
    assert (s.num_b, s.num_wanted_b) == (2, 3)
    assert s.realised_b_ratio == pytest.approx(2 / 6)
    assert (s.drop_stale_total, s.drop_oldest_total, s.sync_total) == (2, 1, 6)
    assert (s.ver_lag_mean, s.ver_lag_max) == (1.5, 2)


def test_weight_sync_figures_are_summed_and_shown() -> None:
    sync = {"weight_sync/state_bytes": 4_000_000, "weight_sync/mb_per_s": 100.0}
    rows = [
        ab_row(0),
        ab_row(
            1, **sync, **{"time/weight_sync_s": 0.04, "weight_sync/bytes": 4_000_000, "weight_sync/delta": 0}
        ),
        ab_row(2, **{"weight_sync/step_fraction": 0.08}, **sync, **{"time/weight_sync_s": 0.01}),
        ab_row(3, **{"weight_sync/bytes": 1_000_000, "weight_sync/delta": 1}),  # no time: not a sync row
    ]
    rows[2].update({"weight_sync/bytes": 1_000_000, "weight_sync/delta": 1})
    rows[1]["weight_sync/step_fraction"] = 0.02
    s = summarize_train_ab(rows, Fraction(0))
    assert (s.num_weight_syncs, s.num_delta_syncs) == (2, 1)
    assert s.sync_s_total == pytest.approx(0.05)
    assert (s.sync_mb_sent, s.sync_mb_state) == (5.0, 8.0)
    assert (s.sync_step_fraction_mean, s.sync_step_fraction_max) == (pytest.approx(0.05), 0.08)
    text = render_train_ab("t", "s", s, None, Figures([]), "plots", [])
    assert "| weight syncs: MB sent / of state dicts | 5.0 / 8.0 |" in text
    assert "2 syncs, 1 delta" in text


def test_skip_to_a_without_async_flag_is_wanted_b_trained_a() -> None:
    assert is_skip_to_a({"kind": "A", "policy_wants_b": True})
    assert not is_skip_to_a({"kind": "B", "policy_wants_b": True})
    assert not is_skip_to_a({"kind": "A", "policy_wants_b": False})


def test_run_without_b_steps_has_no_f1() -> None:
    s = summarize_train_ab([ab_row(s) for s in range(3)], Fraction(0))
    assert s.num_b == 0 and s.f1_last is None and s.f1_best is None


def test_best_f1_is_the_earliest_maximum() -> None:
    rows = [
        ab_row(0, "B", **{"rollout/f1": 0.5}),
        ab_row(1, "B", **{"rollout/f1": 0.5}),
        ab_row(2, "B", **{"rollout/f1": 0.2}),
    ]
    s = summarize_train_ab(rows, None)
    assert s.f1_best is not None and s.f1_best.step == 0
    assert s.f1_last is not None and s.f1_last.step == 2


def test_missing_keys_do_not_break_the_summary() -> None:
    s = summarize_train_ab([{"step": 0, "kind": "A"}, {"step": 1, "kind": "B", "loss": None}], None)
    assert (s.num_a, s.num_b) == (1, 1)
    assert s.terms == [] and s.tokens_per_s is None


def test_summarize_train_ab_needs_rows() -> None:
    with pytest.raises(ValueError, match="no metrics rows"):
        summarize_train_ab([], None)


def test_realised_b_ratio_and_loss_terms() -> None:
    rows = [ab_row(0), ab_row(1, "B"), ab_row(2), ab_row(3, "B")]
    assert realised_b_ratio(rows) == [0.0, 0.5, pytest.approx(1 / 3), 0.5]
    assert loss_terms(rows) == ["loss", "loss/bbox_ciou", "loss/ce"]


def test_summarize_eval() -> None:
    assert summarize_eval([]) is None
    ev = summarize_eval([{"step": 4, "f1": 0.2, "precision": 0.3}, {"step": 8, "f1": 0.1, "recall": 0.05}])
    assert ev is not None and ev.f1_best.step == 4 and ev.f1_last.step == 8
    assert (ev.precision_last, ev.recall_last) == (0.3, 0.05)


# --------------------------------------------------------------------------- Stage-B


def selection(label: str, verdict: str | None, step: int, epoch: int = 0) -> dict[str, Any]:
    return {
        "epoch": epoch,
        "guidance_step": step,
        "label": label,
        "verdict": verdict,
        "label_match": verdict == label,
        "num_pass": int(verdict == "pass") * 2,
        "num_fail": int(verdict == "fail") * 2,
        "num_malformed": 2 if verdict is None else 0,
    }


def window(n: int, accuracy: float, step: int, changes: int = 0) -> dict[str, Any]:
    return {
        "window": n,
        "epoch": 0,
        "num_batches": 1,
        "guidance_step": step,
        "num_tickets": 4,
        "accuracy": accuracy,
        "fp_rate": 1 - accuracy,
        "fn_rate": 0.0,
        "num_fp": 0,
        "num_fn": 0,
        "num_guidance_changes": changes,
        "elapsed_s": 2.0,
    }


def test_stage_b_summary_from_selections() -> None:
    selections = [
        selection("fail", "pass", 0),
        selection("pass", "pass", 0),
        selection("pass", "fail", 0),
        selection("fail", None, 0),
        selection("fail", "fail", 1, epoch=1),
        selection("pass", "pass", 1, epoch=1),
        selection("fail", "fail", 1, epoch=1),
        selection("pass", "pass", 1, epoch=1),
    ]
    metrics = [window(0, 0.25, 1, changes=1), window(1, 1.0, 1)]
    reflections = [
        {
            "guidance_step_before": 0,
            "guidance_step_after": 1,
            "changed": True,
            "accepted": [{}, {}],
            "dropped": [{}],
        },
        {
            "guidance_step_before": 1,
            "guidance_step_after": 1,
            "changed": False,
            "accepted": [],
            "dropped": None,
        },
    ]
    guidance = {"step": 1, "experiences": {"G0": "focus", "G1": "red\nmeans fail"}}
    s = summarize_stage_b(metrics, selections, reflections, guidance)
    assert (s.num_tickets, s.num_windows, s.num_batches, s.num_epochs) == (8, 2, 2, 2)
    assert (s.accuracy_first, s.accuracy_last) == (0.25, 1.0)
    assert s.accuracy_overall == pytest.approx(5 / 8)
    assert (s.num_fp, s.num_fn) == (1, 1)
    assert s.fp_rate == pytest.approx(1 / 4) and s.fn_rate == pytest.approx(1 / 4)
    assert s.num_no_verdict == 1 and (s.num_malformed, s.num_candidates) == (2, 16)
    assert (s.guidance_step_first, s.guidance_step_last) == (0, 1)
    assert (s.num_reflections, s.num_guidance_changes, s.num_ops_accepted, s.num_ops_dropped) == (2, 1, 2, 1)
    assert s.tickets_per_s == pytest.approx(8 / 4.0)
    assert s.experiences == {"G0": "focus", "G1": "red\nmeans fail"}


def test_stage_b_summary_from_windows_only() -> None:
    metrics = [window(0, 0.5, 0), window(1, 1.0, 2, changes=1)]
    metrics[0]["num_fp"] = 2
    s = summarize_stage_b(metrics, [], [], None)
    assert s.num_tickets == 8 and s.accuracy_overall == pytest.approx(0.75)
    assert s.num_fp == 2 and s.fp_rate is None
    assert (s.guidance_step_first, s.guidance_step_last) == (0, 2)
    assert s.experiences == {}
    assert cumulative_tickets(metrics) == [4, 8]
    assert guidance_change_tickets(metrics) == [8]


def test_stage_b_summary_needs_rows() -> None:
    with pytest.raises(ValueError, match="no Stage-B"):
        summarize_stage_b([], [], [], None)


# --------------------------------------------------------------------------- detection + markdown


def test_find_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run directory not found"):
        find_runs(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"no metrics\.jsonl in"):
        find_runs(tmp_path)
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "metrics.jsonl").write_text(json.dumps(ab_row(0)) + "\n")
    assert [(r.kind, r.path.name) for r in find_runs(tmp_path / "ab")] == [("train_ab", "ab")]
    for mission in ("run/m1", "run/m2"):
        (tmp_path / "sb" / mission).mkdir(parents=True)
        for name in ("metrics.jsonl", "selections.jsonl"):
            (tmp_path / "sb" / mission / name).write_text("")
    assert [r.path.name for r in find_runs(tmp_path / "sb")] == ["m1", "m2"]
    assert [r.path.name for r in find_runs(tmp_path / "sb" / "run")] == ["m1", "m2"]
    assert [(r.kind, r.path.name) for r in find_runs(tmp_path / "sb/run/m1")] == [("stage_b", "m1")]


def test_an_eval_dir_interrupted_while_writing_is_named_as_such(tmp_path: Path) -> None:
    """predictions.coco.json without metrics.json (written last) was 'no metrics.jsonl in DIR: expected ...'."""
    (tmp_path / "predictions.coco.json").write_text("[]\n")
    with pytest.raises(
        ValueError, match=r"holds predictions\.coco\.json but no metrics\.json: .*--overwrite"
    ):
        find_runs(tmp_path)
    (tmp_path / "metrics.json").write_text("{}\n")
    assert [r.kind for r in find_runs(tmp_path)] == ["eval"]


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, "n/a"), (3, "3"), (12345.0, "12,345"), (0.123456, "0.1235"), (123456.7, "123,457")],
)
def test_fmt(value: float | None, text: str) -> None:
    assert fmt(value) == text


def test_fmt_ratio() -> None:
    assert fmt_ratio(Fraction(1, 4)) == "0.25"
    assert fmt_ratio(Fraction(1, 3)) == "1/3 (0.3333)"
    assert fmt_ratio(None) == "n/a"


def test_render_train_ab_links_plots_and_lists_skipped() -> None:
    rows = [ab_row(s, channel_for_step(s, 0.5)) for s in range(4)]
    figures = Figures(
        plots=[Plot("loss.png", "Loss per term", "cap")], skipped=[Skipped("queue", "step-mode run")]
    )
    text = render_train_ab(
        "T", "sub", summarize_train_ab(rows, Fraction(1, 2)), None, figures, "report", ["a note"]
    )
    assert "![Loss per term](report/loss.png)" in text
    assert "- queue: step-mode run." in text
    assert "| Channel-A / Channel-B steps | 2 / 2 |" in text
    assert "| B ratio: realised / target | 0.5000 / 0.5 |" in text
    assert "| `loss/ce` | 8 (step 0) | 5 (step 3) | -3 | 5 |" in text
    assert "## Notes" in text and "- a note" in text


def test_report_command_imports_matplotlib_only_when_run() -> None:
    code = "import sys, stagectl.cli.report\nprint('matplotlib' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_optimizer_plot_draws_the_update_share_or_says_why_not(tmp_path: Path) -> None:
    from stagectl.report.plots_train_ab import optimizer_plot

    rows = [{"step": s, "grad_norm": 1.0, "optim/update_nonzero_frac": 0.7} for s in range(3)]
    drawn = optimizer_plot(rows, tmp_path)
    assert isinstance(drawn, Plot) and (tmp_path / drawn.file).stat().st_size > 0
    older = optimizer_plot([{"step": 0, "grad_norm": 1.0}], tmp_path)
    assert isinstance(older, Skipped) and "update_nonzero_frac" in older.reason


def test_stage_b_progress_notes_say_a_run_did_not_finish_and_what_it_skipped() -> None:
    from stagectl.report.stage_b import progress_notes

    finished = {"status": "finished", "epoch": 2, "batch_index": 16, "num_bad_ticket_lines": 0}
    assert progress_notes(finished, "RUN") == []
    stopped = {
        **finished,
        "status": "stopped",
        "stopped_by_signal": 2,
        "epoch": 0,
        "batch_index": 3,
        "num_bad_ticket_lines": 2,
        "bad_ticket_lines": ["t.jsonl:4: not valid JSON", "t.jsonl:8: label"],
    }
    notes = progress_notes(stopped, "RUN")
    assert notes[0].startswith("the run did not finish: stopped by signal 2 before global batch 3 (epoch 0)")
    assert (
        notes[1].startswith("2 bad ticket line(s) skipped")
        and "First: t.jsonl:4: not valid JSON; t.jsonl:8" in notes[1]
    )
    assert (
        "did not finish (still running, or killed)"
        in progress_notes({**finished, "status": "running"}, "RUN")[0]
    )
    failed = {**finished, "status": "failed", "epoch": 7, "batch_index": 29, "error": "server gone"}
    assert progress_notes(failed, "RUN")[0].startswith(
        "the run did not finish: failed before global batch 29 (epoch 7): server gone; once the cause is fixed"
    )
    assert "unknown" in progress_notes(None, "RUN")[0]


@pytest.mark.parametrize(
    ("progress", "note"),
    [
        ("[1, 2]", "`progress.json` is not a JSON object (it holds a list)."),
        ('{"status": "finished", "num_bad_ticket_lines": "many"}', None),
    ],
)
def test_a_stage_b_progress_file_that_is_not_one_is_noted_not_fatal(
    tmp_path: Path, progress: str, note: str | None
) -> None:
    """A progress.json holding a list was reported as `no progress.json` (a run of an older stagectl); one whose
    `num_bad_ticket_lines` was not a number ended `stagectl report` with `invalid literal for int()`."""
    from stagectl.report.write import write_stage_b_report
    from tests.helpers import write_report_dirs

    _, _, mission = write_report_dirs(tmp_path)
    (mission / "progress.json").write_text(progress)
    written = write_stage_b_report(mission)
    assert not any("no `progress.json`" in line for line in written.notes)
    if note is not None:
        assert note in written.notes


def test_stage_b_progress_notes_tell_a_killed_run_from_a_running_one(tmp_path: Path) -> None:
    import json
    import os
    import socket

    from stagectl.report.stage_b import progress_notes

    running = {"status": "running", "epoch": 1, "batch_index": 9, "num_bad_ticket_lines": 0}
    host = socket.gethostname()
    (tmp_path / "running.json").write_text(json.dumps({"pid": os.getpid(), "host": host, "started": None}))
    assert progress_notes(running, str(tmp_path))[0] == (
        f"no end recorded yet (before global batch 9 (epoch 1)): still running (pid {os.getpid()} on {host})."
    )
    (tmp_path / "running.json").write_text(json.dumps({"pid": 2**22 + 17, "host": host, "started": 1}))
    note = progress_notes(running, str(tmp_path))[0]
    assert note.startswith("the run did not finish before global batch 9 (epoch 1): its process (pid 4194321")
    assert "killed (SIGKILL" in note and note.endswith("`--resume` continues it.")
