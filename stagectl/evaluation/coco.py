"""COCO-format ground truth and results built from detection samples, and COCO bbox metrics.

Ids. A sample's COCO ids ride along in the JSONL (`image_id` on a line, `category_id` on an object, as
`stagectl convert coco` writes them); predictions then go back in COCO's own ids. Data without them gets
image ids by line order (1, 2, ...) and category ids by sorted `desc` (1, 2, ...). Ids are all-or-none:
a file where some lines (or objects) carry them and others do not is refused, since the assigned ids
could collide with the given ones.

Boxes. Samples store norm-1000 bins; both ground truth and predictions are decoded to pixel corners with
the same codec and written as COCO `[x, y, w, h]` = `[x1, y1, x2 - x1, y2 - y1]`. COCOeval sorts objects
into small / medium / large by the annotation's `area` field: an object's COCO `area` when the data has it
(`stagectl convert coco` keeps it: the mask area, as the official evaluation uses), else the box's `w * h`.

Crowd. A sample's `crowd` regions (COCO's `iscrowd: 1` annotations, which `stagectl convert coco` keeps
apart from the objects) are ground-truth annotations with `iscrowd: 1`: COCOeval matches a prediction
left unmatched to one of them as ignored, not as a false positive, and never counts them as objects to
find, as in the official evaluation. Data without them has no crowd.

Class-agnostic metrics (`coco_summary(..., use_cats=False)`) are the evaluator's own `params.useCats = 0`:
any prediction may match any ground-truth box, labels ignored, a desc that is no category too
(`agnostic_results`); the same numbers as pycocotools' (tested on the written files,
tests/unit/evaluation/test_core.py).

Metrics come from faster-coco-eval (`COCOeval_faster`): it gives the same numbers as pycocotools (the
reference; bench/bench_coco_eval.py compares all 12 summary numbers) in less time (BENCHMARKS.md), which
matters because train-ab's periodic eval runs on rank 0 while the other ranks wait (docs/evaluation.md).
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stagectl.data.sample import DetectionSample, bins_to_pixel_box
from stagectl.detection.coords import Box

# COCOeval's `stats`, in its order (AR at maxDets 1/10/100; the size buckets at 100 detections)
COCO_METRICS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


@dataclass(frozen=True)
class CocoIds:
    """Image ids (one per sample, in order) and the category id of every known `desc`."""

    image_ids: list[int]
    category_of_desc: dict[str, int]
    category_names: dict[int, str]  # id -> name (the first desc seen with that id)
    from_data: bool  # the ids came with the data (COCO); False: assigned here


def assign_ids(samples: Sequence[DetectionSample], source: str) -> CocoIds:
    """COCO ids for `samples` (see the module docstring); `ValueError` names the offending line."""
    # the file's own line numbers (blank lines skipped by the loader count), else the sample's place
    lines = [s.line_no if s.line_no is not None else k + 1 for k, s in enumerate(samples)]
    has_image = [s.image_id is not None for s in samples]
    objects = [(lines[k], obj) for k, s in enumerate(samples) for obj in [*s.objects, *s.crowd]]
    has_category = [obj.category_id is not None for _, obj in objects]
    for name, flags in (("image_id", has_image), ("category_id", has_category)):
        if any(flags) and not all(flags):
            k = flags.index(False)
            where = f"line {lines[k]}" if name == "image_id" else f"line {objects[k][0]}"
            raise ValueError(
                f"{source}: {where} has no {name} while other lines have one; COCO ids must be on every "
                "line and object or on none (re-run `stagectl convert coco`, or drop them all)"
            )
    if all(has_image) and samples:
        image_ids = [int(s.image_id) for s in samples if s.image_id is not None]
        seen: dict[int, int] = {}
        for k, image_id in enumerate(image_ids):
            if image_id in seen:
                raise ValueError(
                    f"{source}: line {lines[k]} repeats image_id {image_id} of line {seen[image_id]}"
                )
            seen[image_id] = lines[k]
    else:
        image_ids = list(range(1, len(samples) + 1))
    names: dict[int, str] = {}
    category_of_desc: dict[str, int] = {}
    if all(has_category) and objects:
        for k, obj in objects:
            assert obj.category_id is not None
            known = category_of_desc.setdefault(obj.desc, obj.category_id)
            if known != obj.category_id:
                raise ValueError(
                    f"{source}: line {k}: desc {obj.desc!r} has category_id {obj.category_id} here but "
                    f"{known} elsewhere; one name must map to one category"
                )
            names.setdefault(obj.category_id, obj.desc)
    else:
        for index, desc in enumerate(sorted({obj.desc for _, obj in objects}), start=1):
            category_of_desc[desc] = index
            names[index] = desc
    return CocoIds(image_ids, category_of_desc, names, from_data=all(has_image) and all(has_category))


def xywh(bins: Box, width: int, height: int) -> list[float]:
    """A norm-1000 box as COCO `[x, y, w, h]` in pixels."""
    x1, y1, x2, y2 = bins_to_pixel_box(bins, width, height)
    return [x1, y1, x2 - x1, y2 - y1]


def ground_truth(samples: Sequence[DetectionSample], ids: CocoIds) -> dict[str, Any]:
    """The samples as a COCO instances dict (`images`, `annotations`, `categories`)."""
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for sample, image_id in zip(samples, ids.image_ids, strict=True):
        images.append(
            {"id": image_id, "width": sample.width, "height": sample.height, "file_name": sample.images[0]}
        )
        for crowd, objects in ((0, sample.objects), (1, sample.crowd)):
            for obj in objects:
                box = xywh(obj.bbox_2d, sample.width, sample.height)
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": image_id,
                        "category_id": ids.category_of_desc[obj.desc],
                        "bbox": box,
                        "area": obj.area if obj.area is not None else box[2] * box[3],
                        "iscrowd": crowd,
                    }
                )
    categories = [{"id": cid, "name": name} for cid, name in sorted(ids.category_names.items())]
    return {"images": images, "annotations": annotations, "categories": categories}


@dataclass(frozen=True)
class CocoMetrics:
    summary: dict[str, float]  # COCO_METRICS -> value (-1: no ground truth in that size bucket)
    per_class_ap: dict[str, float]  # category name -> AP at IoU .50:.95 (-1: no ground truth of it)
    pr_recall: list[float]  # the 101 recall thresholds
    pr_precision: list[float]  # precision at IoU 0.5, all sizes, 100 detections, mean over classes


def _evaluate(gt: dict[str, Any], results: Sequence[dict[str, Any]], *, use_cats: bool) -> Any:
    """faster-coco-eval's COCOeval run on copies of `gt` and `results` (both non-empty)."""
    from faster_coco_eval import COCO, COCOeval_faster

    with contextlib.redirect_stdout(io.StringIO()):  # it prints its own table
        coco_gt = COCO(copy.deepcopy(gt))
        evaluator = COCOeval_faster(coco_gt, coco_gt.loadRes(copy.deepcopy(list(results))), "bbox")
        evaluator.params.useCats = int(use_cats)
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return evaluator


def _has_objects(gt: dict[str, Any]) -> bool:
    """Whether `gt` has an object to find (crowd regions are not: COCOeval only ignores predictions on them)."""
    return any(not a["iscrowd"] for a in gt["annotations"])


# COCOeval's area ranges (its `params.areaRng`, bounds inclusive) of each summary number: "all" for the rest
_ALL_AREAS = (0.0, 1e5**2)
_AREA_OF_METRIC = {
    **dict.fromkeys(("APs", "ARs"), (0.0, 32.0**2)),
    **dict.fromkeys(("APm", "ARm"), (32.0**2, 96.0**2)),
    **dict.fromkeys(("APl", "ARl"), (96.0**2, 1e5**2)),
}


def _empty_summary(gt: dict[str, Any]) -> dict[str, float]:
    """The summary of no predictions, as COCOeval gives it: 0 (nothing found) where its area range has an
    object to find, -1 where it has none (a size bucket without ground truth, or no ground truth at all)."""
    areas = [a["area"] for a in gt["annotations"] if not a["iscrowd"]]
    summary = {}
    for name in COCO_METRICS:
        low, high = _AREA_OF_METRIC.get(name, _ALL_AREAS)
        summary[name] = 0.0 if any(low <= area <= high for area in areas) else -1.0
    return summary


def coco_summary(
    gt: dict[str, Any], results: Sequence[dict[str, Any]], *, use_cats: bool = True
) -> dict[str, float]:
    """The 12 COCO summary numbers (`COCO_METRICS`); `use_cats=False` is COCOeval's own class-agnostic
    mode (`params.useCats = 0`: every prediction may match every ground-truth box, labels ignored)."""
    if not results or not _has_objects(gt):  # COCO's loadRes refuses an empty list
        return _empty_summary(gt)
    stats = _evaluate(gt, results, use_cats=use_cats).stats
    return {name: float(v) for name, v in zip(COCO_METRICS, stats[: len(COCO_METRICS)], strict=True)}


def agnostic_results(
    gt: dict[str, Any], results: Sequence[dict[str, Any]], unknown: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """What the class-agnostic evaluation scores: every valid prediction, also those whose desc is no
    category of `gt` (`unknown`: COCO results rows without `category_id`). COCOeval's `useCats = 0` still
    gathers the predictions of `gt`'s categories only, so they get its first one (the id can change the
    order of exactly tied scores: COCOeval lists them category by category before its stable score sort)."""
    if not unknown or not gt["categories"]:
        return list(results)
    any_category = gt["categories"][0]["id"]
    return [*results, *({**row, "category_id": any_category} for row in unknown)]


def coco_metrics(gt: dict[str, Any], results: Sequence[dict[str, Any]]) -> CocoMetrics:
    """Class-aware COCO bbox metrics of `results` (COCO results rows) against `gt` (a COCO instances dict)."""
    recall = [round(0.01 * k, 2) for k in range(101)]
    names = {c["id"]: c["name"] for c in gt["categories"]}
    if not results or not _has_objects(gt):  # COCO's loadRes refuses an empty list; nothing is found
        has_gt = {a["category_id"] for a in gt["annotations"] if not a["iscrowd"]}
        return CocoMetrics(
            _empty_summary(gt),
            {name: (0.0 if cid in has_gt else -1.0) for cid, name in names.items()},
            recall,
            [0.0] * len(recall),
        )
    evaluator = _evaluate(gt, results, use_cats=True)
    summary = {
        name: float(v) for name, v in zip(COCO_METRICS, evaluator.stats[: len(COCO_METRICS)], strict=True)
    }
    precision = np.asarray(evaluator.eval["precision"])  # (T iou, R recall, K class, A area, M maxDets)
    per_class = {}
    for k, cid in enumerate(evaluator.params.catIds):
        values = precision[:, :, k, 0, -1]
        values = values[values > -1]
        per_class[names[cid]] = float(values.mean()) if values.size else -1.0
    at_50 = precision[0, :, :, 0, -1]  # (R, K)
    curve = [float(row[row > -1].mean()) if (row > -1).any() else 0.0 for row in at_50]
    return CocoMetrics(summary, per_class, recall, curve)
