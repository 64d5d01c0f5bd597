"""train-ab's `eval_gt.coco.json` when a resume changed the held-out set: it kept the first set's, so the
report's AP intervals scored the new evals' predictions against the wrong images. The earlier set is kept
as `eval_gt.before-step-N.coco.json` and each eval's AP is re-scored against the set it ran on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stagectl.evaluation.coco import coco_summary
from stagectl.learner.evaluate import EVAL_GT_BEFORE, EVAL_GT_FILE, Evaluator
from stagectl.report.ap_intervals import GT_BEFORE, ground_truth_of, load_run_ap


def _set(boxes: list[list[float]]) -> dict[str, Any]:
    """One image per box, one object each."""
    images = [{"id": k + 1, "width": 100, "height": 100} for k in range(len(boxes))]
    anns = [
        {"id": k + 1, "image_id": k + 1, "category_id": 1, "bbox": b, "area": b[2] * b[3], "iscrowd": 0}
        for k, b in enumerate(boxes)
    ]
    return {"images": images, "annotations": anns, "categories": [{"id": 1, "name": "cat"}]}


def _writer(out: Path) -> Evaluator:
    evaluator: Evaluator = object.__new__(Evaluator)
    evaluator.gt_path = out / EVAL_GT_FILE
    evaluator._gt_written = None
    return evaluator


def test_a_changed_held_out_set_keeps_the_earlier_one_and_each_eval_is_scored_on_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = _set([[10, 10, 30, 30], [50, 50, 20, 20]]), _set([[0, 0, 50, 50], [40, 40, 40, 40]])
    writer = _writer(tmp_path)
    writer._write_ground_truth(first, 2)
    writer._write_ground_truth(first, 4)  # the same set: nothing kept aside, nothing said
    assert sorted(p.name for p in tmp_path.iterdir()) == [EVAL_GT_FILE]
    _writer(tmp_path)._write_ground_truth(first, 6)  # a resume with the same data.eval: nothing changes
    assert sorted(p.name for p in tmp_path.iterdir()) == [EVAL_GT_FILE]
    _writer(tmp_path)._write_ground_truth(second, 6)  # a resume from checkpoint-4 with another data.eval
    kept = tmp_path / EVAL_GT_BEFORE.format(step=6)
    assert (
        json.loads(kept.read_text()) == first and json.loads((tmp_path / EVAL_GT_FILE).read_text()) == second
    )
    assert GT_BEFORE.fullmatch(kept.name) and "held-out set differs" in capsys.readouterr().err
    # each eval's predictions: exact boxes of the set it ran on
    rows = [
        {"step": step, "predictions": [{**a, "score": 1.0} for a in gt["annotations"]]}
        for step, gt in ((2, first), (4, first), (6, second))
    ]
    (tmp_path / "eval_predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [ground_truth_of(tmp_path, s).name for s in (2, 4, 6, 8)] == [kept.name] * 2 + [EVAL_GT_FILE] * 2
    for step in (2, 4, 6):
        assert load_run_ap(tmp_path, step).ap(range(2)) == pytest.approx(1.0)
    assert coco_summary(first, rows[2]["predictions"])["AP"] < 0.5  # what the kept first set gave step 6
