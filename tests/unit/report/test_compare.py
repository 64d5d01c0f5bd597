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


def _ablation_run(path: Path, b_ratio: float, data_eval: dict[str, object]) -> Path:
    """A run dir with one eval row of 4 images (config, eval.jsonl with per-image counters, metrics.jsonl)."""
    import json

    import yaml

    path.mkdir()
    config = {
        "training": {"seed": 0},
        "stage2_ab": {"schedule": {"b_ratio": b_ratio}, "channel_b": {"target": "clean_prefix"}},
        "data": {"eval": data_eval},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    fields = ["n_gt", "n_valid", "n_matched", "n_invalid", "n_truncated", "n_dup", "n_matched_desc"]
    row = {"step": 10, "f1": 0.5, "per_image_fields": fields, "per_image": [[2, 2, 1, 0, 0, 0, 1]] * 4}
    (path / "eval.jsonl").write_text(json.dumps(row) + "\n")
    (path / "metrics.jsonl").write_text('{"step": 9, "time/step_s": 1.0}\n')
    return path


@pytest.mark.parametrize(
    ("other", "key"),
    [
        ({"synthetic": {"seed": 2, "num_samples": 4}, "max_samples": 64}, "synthetic"),
        ({"synthetic": {"seed": 1, "num_samples": 4}, "max_samples": 32}, "max_samples"),
        ({"synthetic": {"seed": 1, "num_samples": 4}, "max_samples": 64, "score": "coord"}, "score"),
    ],
)
def test_runs_evaluated_on_other_images_or_otherwise_are_refused(
    tmp_path: Path, other: dict[str, object], key: str
) -> None:
    """Two runs whose held-out sets differ (another synthetic seed: the same number of images, so nothing
    else noticed) were compared 'paired on images' as if image k were the same image in both."""
    from stagectl.report.compare import compare, load_run

    base = {"synthetic": {"seed": 1, "num_samples": 4}, "max_samples": 64}
    a = load_run(_ablation_run(tmp_path / "a", 0.0, base))
    b = load_run(_ablation_run(tmp_path / "b", 0.5, other))
    with pytest.raises(ValueError, match=rf"data\.eval\.{key} is .* in {a.path} but .* in {b.path}"):
        compare([a, b])


def test_runs_that_differ_only_in_when_they_evaluate_are_compared(tmp_path: Path) -> None:
    from stagectl.report.compare import compare, load_run

    base = {"jsonl": "/data/val.jsonl", "max_samples": None}
    a = load_run(_ablation_run(tmp_path / "a", 0.0, {**base, "every_steps": 5}))
    b = load_run(_ablation_run(tmp_path / "b", 0.5, {**base, "every_steps": 10, "gallery_images": 0}))
    step, rows = compare([a, b])
    assert step == 10 and [r.variant for r in rows] == ["A-only", "AB b=0.5 clean_prefix"]


def test_a_run_given_twice_is_refused(tmp_path: Path) -> None:
    """`stagectl report runs/a runs/a/` counted one run as two seeds of its variant."""
    from stagectl.report.compare import compare, load_run

    path = _ablation_run(tmp_path / "a", 0.0, {"jsonl": "/data/val.jsonl"})
    with pytest.raises(ValueError, match="is given twice"):
        compare([load_run(path), load_run(Path(f"{path}/"))])
    (tmp_path / "x").mkdir()
    with pytest.raises(ValueError, match="is given twice"):
        compare([load_run(path), load_run(tmp_path / "x" / ".." / "a")])


def test_a_run_without_per_image_counters_is_named(tmp_path: Path) -> None:
    import json

    from stagectl.report.compare import compare, load_run

    setup = {"jsonl": "/data/val.jsonl"}
    a = load_run(_ablation_run(tmp_path / "a", 0.0, setup))
    b_dir = _ablation_run(tmp_path / "b", 0.5, setup)
    (b_dir / "eval.jsonl").write_text(json.dumps({"step": 10, "f1": 0.5}) + "\n")  # an old run's row
    with pytest.raises(ValueError, match=rf"^{b_dir / 'eval.jsonl'} step 10: eval row has no per_image"):
        compare([a, load_run(b_dir)])


def test_an_out_dir_that_cannot_hold_the_comparison_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """`--out` under a file, or a directory where comparison.html goes: a traceback after comparison.md and
    the plot were written; now one error naming the path, and nothing written."""
    from stagectl.report.compare import write_comparison

    base = {"synthetic": {"seed": 1, "num_samples": 4}, "max_samples": 64}
    runs = [_ablation_run(tmp_path / "a", 0.0, base), _ablation_run(tmp_path / "b", 0.5, base)]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=f"--out: cannot write to {blocker}/cmp: {blocker} is a file"):
        write_comparison(runs, blocker / "cmp")
    out = tmp_path / "cmp"
    (out / "comparison.html").mkdir(parents=True)
    with pytest.raises(ValueError, match=f"--out: cannot write {out}/comparison.html: it is a directory"):
        write_comparison(runs, out)
    assert [p.name for p in out.iterdir()] == ["comparison.html"]


def test_a_comparison_stopped_while_drawing_leaves_the_earlier_one_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plot was drawn straight into `comparison_f1.png`: a comparison stopped (Ctrl-C, SIGKILL, a full
    disk) while matplotlib wrote it left a truncated PNG that the earlier comparison.md showed."""
    from matplotlib.figure import Figure

    from stagectl.report.compare import write_comparison

    base = {"synthetic": {"seed": 1, "num_samples": 4}, "max_samples": 64}
    runs = [_ablation_run(tmp_path / "a", 0.0, base), _ablation_run(tmp_path / "b", 0.5, base)]
    out = tmp_path / "cmp"
    write_comparison(runs, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def half_written(self: Figure, target: object, **kwargs: object) -> None:
        if isinstance(target, (str, Path)):
            Path(target).write_bytes(b"\x89PNG half")
        else:
            target.write(b"\x89PNG half")  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", half_written)
    with pytest.raises(KeyboardInterrupt):
        write_comparison(runs, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
