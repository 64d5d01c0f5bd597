"""`evaluation.coco` against pycocotools' `COCOeval` run directly: the summary numbers and the per-class AP
of no predictions at all (COCO's loadRes refuses an empty list, so stagectl writes them itself) are the
reference's, and the ground truth the eval writes keeps COCO's ids, `area` and `iscrowd` and moves a box
only as docs/evaluation.md says (half a bin per corner; a right or bottom edge past W-1 / H-1 to it)."""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Any

import pytest

from stagectl.data.sample import DetectionSample, DetObject, pixel_box_to_bins
from stagectl.evaluation.coco import COCO_METRICS, assign_ids, coco_metrics, coco_summary, ground_truth


def _reference(gt: dict[str, Any], results: list[dict[str, Any]], use_cats: int = 1) -> Any:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = copy.deepcopy(gt)
        coco.createIndex()
        evaluator = COCOeval(coco, coco.loadRes(copy.deepcopy(results)), "bbox")
        evaluator.params.useCats = use_cats
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return evaluator


def _annotation(k: int, image_id: int, category_id: int, side: float, *, crowd: int = 0) -> dict[str, Any]:
    return {
        "id": k,
        "image_id": image_id,
        "category_id": category_id,
        "bbox": [1.0, 1.0, side, side],
        "area": side * side,
        "iscrowd": crowd,
    }


# (what the ground truth holds, its annotations): every size bucket with and without objects
CASES = {
    "small only": [_annotation(1, 1, 1, 20.0)],
    "medium and a large crowd": [_annotation(1, 1, 1, 50.0), _annotation(2, 1, 1, 200.0, crowd=1)],
    "large only": [_annotation(1, 1, 1, 200.0)],
    "small and large, two classes": [_annotation(1, 1, 1, 10.0), _annotation(2, 1, 2, 150.0)],
    "area on a bucket bound": [_annotation(1, 1, 1, 32.0)],  # 32**2: small and medium, as in COCOeval
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_predictions_give_cocoevals_numbers(name: str) -> None:
    """-1 where a size bucket has no object to find (docs/evaluation.md), 0 where nothing was found. The
    reference is COCOeval with one prediction of a category without ground truth, which it leaves out of
    every number (so it is the numbers of no prediction). Before, every bucket of an eval without a valid
    prediction (an untrained model) said 0, APl of a set without large objects included."""
    gt = {
        "images": [{"id": 1, "width": 640, "height": 480}, {"id": 2, "width": 640, "height": 480}],
        "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}, {"id": 3, "name": "owl"}],
        "annotations": CASES[name],
    }
    neutral = [{"image_id": 2, "category_id": 3, "bbox": [0.0, 0.0, 5.0, 5.0], "score": 0.5}]
    reference = _reference(gt, neutral)
    expected = dict(zip(COCO_METRICS, (float(v) for v in reference.stats), strict=True))
    ours = coco_metrics(gt, [])
    assert ours.summary == expected
    assert coco_summary(gt, []) == expected
    agnostic = _reference(gt, neutral, use_cats=0)  # the owl would count here: compare the buckets' -1 only
    assert {k: v == -1 for k, v in coco_summary(gt, [], use_cats=False).items()} == {
        k: float(v) == -1 for k, v in zip(COCO_METRICS, agnostic.stats, strict=True)
    }
    precision = reference.eval["precision"]  # (IoU, recall, class, area, maxDets)
    names = {c["id"]: c["name"] for c in gt["categories"]}
    per_class = {
        names[cid]: (0.0 if (precision[:, :, k, 0, -1] > -1).any() else -1.0)
        for k, cid in enumerate(reference.params.catIds)
    }
    assert ours.per_class_ap == per_class


def test_the_written_ground_truth_is_cocos_within_the_documented_box_moves() -> None:
    """COCO ids, category ids, `area` and `iscrowd` pass through unchanged; a corner moves by at most half
    a bin ((W - 1) / 1998 px), except a right / bottom edge past W - 1 / H - 1, which lands on it (bin 999
    decodes to W - 1: up to 1 px; docs/evaluation.md quantifies what that does to AP)."""
    width, height = 333, 517
    coco_boxes = [(0.0, 0.0, 333.0, 517.0), (100.1, 200.2, 40.4, 30.3), (320.5, 500.25, 12.5, 16.75)]
    objects = [
        DetObject(
            "cat", pixel_box_to_bins((x, y, x + w, y + h), width, height), category_id=90, area=w * h / 2
        )
        for x, y, w, h in coco_boxes
    ]
    crowd = [
        DetObject("dog", pixel_box_to_bins((5.5, 6.5, 50.0, 60.0), width, height), category_id=3, area=9.0)
    ]
    samples = [DetectionSample(["a.png"], width, height, objects, image_id=777, crowd=crowd)]
    gt = ground_truth(samples, assign_ids(samples, "test"))
    assert [i["id"] for i in gt["images"]] == [777]
    assert gt["categories"] == [{"id": 3, "name": "dog"}, {"id": 90, "name": "cat"}]
    rows = gt["annotations"]
    assert [(a["category_id"], a["iscrowd"], a["area"]) for a in rows] == [
        *((90, 0, w * h / 2) for _, _, w, h in coco_boxes),
        (3, 1, 9.0),
    ]
    for (x, y, w, h), row in zip(coco_boxes, rows, strict=False):
        corners = (x, y, x + w, y + h)
        rx, ry, rw, rh = row["bbox"]
        for coco, written, size in zip(corners, (rx, ry, rx + rw, ry + rh), (width, height) * 2, strict=True):
            allowed = (size - 1) / 1998 + 1e-9 if coco <= size - 1 else coco - (size - 1) + 1e-9
            assert abs(coco - written) <= allowed, (corners, row["bbox"])
    assert rows[0]["bbox"] == pytest.approx([0.0, 0.0, width - 1, height - 1])  # the whole image: W-1 x H-1
