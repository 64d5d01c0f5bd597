"""`variant_of`: the label that groups comparison runs into variants (seeds of one variant are pooled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagectl.report.compare import variant_of


def _config(**channel_b: object) -> dict[str, object]:
    return {"stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"target": "clean_prefix", **channel_b}}}


def test_a_only_and_plain_ab() -> None:
    assert variant_of({"stage2_ab": {"schedule": {"b_ratio": 0}}}) == "A-only"
    assert variant_of(_config()) == "AB b=0.5 clean_prefix"


@pytest.mark.parametrize(
    ("channel_b", "suffix"),
    [
        ({"insertion_order": "sorted"}, "/sorted"),
        ({"desc_ce_weight_matched": 0.5}, " desc_matched=0.5"),
        ({"desc_ce_weight_matched": 0.5, "mask_correct_matched_desc": False}, " desc_matched=0.5/unmasked"),
        ({"match": {"assignment": "greedy_iou"}}, " greedy_iou"),
        ({"match": {"desc_gated": True}}, " desc_gated"),
    ],
)
def test_knobs_off_their_defaults_name_the_variant(channel_b: dict[str, object], suffix: str) -> None:
    assert variant_of(_config(**channel_b)) == "AB b=0.5 clean_prefix" + suffix


def test_defaults_written_out_do_not_change_the_label() -> None:
    explicit = _config(
        desc_ce_weight_matched=0.0,
        mask_correct_matched_desc=True,
        match={"assignment": "hungarian", "desc_gated": False},
    )
    assert variant_of(explicit) == variant_of(_config())


def test_a_run_with_a_torn_eval_line_that_failed_is_read_with_notes(tmp_path: Path) -> None:
    """A seed that crashed: its torn last eval line is skipped (it was a JSONDecodeError with no file named)
    and the comparison notes say so, and that the run failed, since it lowers the step every run reached."""
    import json

    from stagectl.report.compare import load_run

    run = tmp_path / "seed1"
    run.mkdir()
    (run / "config.yaml").write_text(
        "training: {seed: 1, max_steps: 300}\nstage2_ab: {schedule: {b_ratio: 0}}\n"
    )
    (run / "eval.jsonl").write_text('{"step": 100, "tp": 3}\n{"step": 200, "t')
    (run / "metrics.jsonl").write_text('{"step": 0, "time/step_s": 2.0}\n')
    end = {
        "global_step": 200,
        "max_steps": 300,
        "stopped_by_signal": None,
        "error": "no space left on device",
    }
    (run / "final_state.json").write_text(json.dumps(end))
    loaded = load_run(run)
    assert list(loaded.evals) == [100] and loaded.train_s_at == {1: 2.0}
    assert loaded.notes == [
        f"`{run}`: `eval.jsonl`: skipped 1 unreadable line(s): 2 (a torn last line: the run was probably "
        "interrupted).",
        f"`{run}` did not finish: failed after step 200 of 300: no space left on device.",
    ]
