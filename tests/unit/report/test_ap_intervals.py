"""AP intervals: the maintained evaluator's AP on every draw, paired differences, missing files named."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stagectl.evaluation.coco import coco_summary
from stagectl.report.ap_intervals import RunAP, ap_intervals, load_run_ap

CATS = [
    {"id": 1, "name": "red circle"},
    {"id": 2, "name": "blue square"},
    {"id": 3, "name": "green triangle"},
]


def _scene(
    seed: int, num_images: int = 12, noise: float = 6.0
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A GT file and predictions near its boxes: some labels wrong, some boxes missed, some extra."""
    rng = random.Random(seed)
    images, anns, preds = [], [], []
    for image_id in range(1, num_images + 1):
        images.append({"id": image_id, "width": 112, "height": 112, "file_name": f"{image_id}.png"})
        for _ in range(rng.randint(1, 3)):
            x, y, w, h = rng.uniform(0, 60), rng.uniform(0, 60), rng.uniform(15, 40), rng.uniform(15, 40)
            cat = rng.randint(1, 3)
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": image_id,
                    "category_id": cat,
                    "bbox": [x, y, w, h],
                    "area": w * h,
                    "iscrowd": 0,
                }
            )
            if rng.random() < 0.85:
                guess = cat if rng.random() < 0.7 else rng.randint(1, 3)
                box = [x + rng.gauss(0, noise), y + rng.gauss(0, noise), w + rng.gauss(0, noise), h]
                preds.append({"image_id": image_id, "category_id": guess, "bbox": box, "score": rng.random()})
        if rng.random() < 0.3:
            preds.append(
                {
                    "image_id": image_id,
                    "category_id": rng.randint(1, 3),
                    "bbox": [5, 5, 20, 20],
                    "score": rng.random(),
                }
            )
    return {"images": images, "annotations": anns, "categories": CATS}, preds


def _subset(
    gt: dict[str, Any], preds: list[dict[str, Any]], positions: list[int]
) -> tuple[dict[str, Any], list]:
    """The draw written out as its own COCO files: every drawn image a new id (repeats included)."""
    images, anns, rows = [], [], []
    for new_id, p in enumerate(positions, start=1):
        old = gt["images"][p]["id"]
        images.append({**gt["images"][p], "id": new_id})
        for a in (a for a in gt["annotations"] if a["image_id"] == old):
            anns.append({**a, "id": len(anns) + 1, "image_id": new_id})
        rows += [{**r, "image_id": new_id} for r in preds if r["image_id"] == old]
    return {"images": images, "annotations": anns, "categories": gt["categories"]}, rows


@pytest.mark.parametrize("use_cats", [True, False])
def test_ap_of_a_draw_is_the_evaluators_ap_of_that_draw_written_out(use_cats: bool) -> None:
    gt, preds = _scene(0)
    run = RunAP(gt, preds, use_cats=use_cats)
    everything = list(range(len(gt["images"])))
    assert run.ap(everything) == pytest.approx(coco_summary(gt, preds, use_cats=use_cats)["AP"], abs=1e-9)
    draw = [0, 0, 3, 5, 5, 5, 7, 11, 2, 2, 9, 1]
    assert run.ap(draw) == pytest.approx(
        coco_summary(*_subset(gt, preds, draw), use_cats=use_cats)["AP"], abs=1e-9
    )


def test_no_predictions_is_zero_ap_and_intervals_hold_the_observed_value() -> None:
    gt, _ = _scene(1)
    assert RunAP(gt, []).ap([0, 1]) == 0.0
    seeds = [RunAP(*_scene(1, noise=n)) for n in (2.0, 3.0, 4.0)]
    worse = [RunAP(*_scene(1, noise=n)) for n in (12.0, 14.0, 16.0)]
    result = ap_intervals(seeds, worse, resamples=60)
    everything = np.arange(len(gt["images"]))
    assert result.value.value == pytest.approx(np.mean([r.ap(everything) for r in seeds]))
    assert result.value.low <= result.value.value <= result.value.high
    assert result.delta is not None and result.delta.value > 0
    assert result.delta.low <= result.delta.value <= result.delta.high
    assert ap_intervals(seeds, resamples=10).delta is None


def test_runs_on_different_images_are_refused_and_missing_files_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="different numbers of images"):
        ap_intervals([RunAP(*_scene(0, 12))], [RunAP(*_scene(0, 10))], resamples=5)
    with pytest.raises(ValueError, match=r"eval_gt\.coco\.json is missing"):
        load_run_ap(tmp_path, 2)
    gt, preds = _scene(2)
    (tmp_path / "eval_gt.coco.json").write_text(json.dumps(gt))
    (tmp_path / "eval_predictions.jsonl").write_text(json.dumps({"step": 4, "predictions": preds}) + "\n")
    with pytest.raises(ValueError, match=r"no eval at step 2 \(steps: \[4\]\)"):
        load_run_ap(tmp_path, 2)
    assert load_run_ap(tmp_path, 4).ap(range(12)) == pytest.approx(coco_summary(gt, preds)["AP"], abs=1e-9)


def test_a_torn_last_predictions_line_is_skipped_and_noted(tmp_path: Path) -> None:
    """A run that crashed while appending its eval predictions: the comparison stopped on a bare
    JSONDecodeError (no file named); the torn line is now skipped and noted, as for eval.jsonl."""
    gt, preds = _scene(2)
    (tmp_path / "eval_gt.coco.json").write_text(json.dumps(gt))
    whole = json.dumps({"step": 4, "predictions": preds})
    (tmp_path / "eval_predictions.jsonl").write_text(whole + "\n" + whole[:40])
    run = load_run_ap(tmp_path, 4)
    assert run.ap(range(12)) == pytest.approx(coco_summary(gt, preds)["AP"], abs=1e-9)
    assert run.notes == [
        "`eval_predictions.jsonl`: skipped 1 unreadable line(s): 2 (a torn last line: the run was probably "
        "interrupted)."
    ]
    (tmp_path / "eval_gt.coco.json").write_text(json.dumps(gt)[:50])
    with pytest.raises(ValueError, match=r"eval_gt\.coco\.json: not valid JSON"):
        load_run_ap(tmp_path, 4)


def test_the_class_agnostic_ap_of_a_run_scores_its_unknown_category_predictions(tmp_path: Path) -> None:
    """train-ab writes the predictions whose desc is no category under `unknown_category`: the class-agnostic
    AP of the eval row scores them (labels ignored), and so must its interval's observed value; the
    class-aware one leaves them out."""
    gt, preds = _scene(3)
    known, unknown = preds[::2], [{k: v for k, v in r.items() if k != "category_id"} for r in preds[1::2]]
    unknown = [{**r, "desc": "purple hexagon"} for r in unknown]
    (tmp_path / "eval_gt.coco.json").write_text(json.dumps(gt))
    row = {"step": 4, "predictions": known, "unknown_category": unknown}
    (tmp_path / "eval_predictions.jsonl").write_text(json.dumps(row) + "\n")
    everything = range(len(gt["images"]))
    agnostic = load_run_ap(tmp_path, 4, use_cats=False).ap(everything)
    assert agnostic == pytest.approx(coco_summary(gt, preds, use_cats=False)["AP"], abs=1e-9)
    assert agnostic != pytest.approx(coco_summary(gt, known, use_cats=False)["AP"], abs=1e-3)  # they count
    aware = load_run_ap(tmp_path, 4).ap(everything)
    assert aware == pytest.approx(coco_summary(gt, known)["AP"], abs=1e-9)
