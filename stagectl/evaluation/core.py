"""The evaluation core, on plain data: each image's rollout judged (strict parse, Hungarian match at IoU
0.5, duplicates, per-object scores, COCO results rows), then every image summed into one metrics dict
(COCO bbox metrics + precision / recall / F1 + invalid and duplicate rates + a per-class AP table).

Per-image outcomes are plain data so ranks can evaluate shards and rank 0 can merge them in image order:
the merged metrics are then those of one rank over all images.

Predictions whose `desc` is no category of the ground truth (an open-vocabulary model naming something
else) cannot be scored by COCO's closed-set evaluator: they are left out of `predictions.coco.json` and
counted (`n_unknown_category`, `unknown_category_rate` of valid predictions). They still count as
predictions for precision / recall / F1, whose matching is class-agnostic, as in training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stagectl.config.rollout import RolloutMatchingConfig
from stagectl.data.sample import DetectionSample
from stagectl.detection.judge import judge_rollout
from stagectl.detection.scores import object_scores
from stagectl.detection.stats import RolloutStats
from stagectl.detection.vocab import TokenVocab
from stagectl.evaluation.coco import COCO_METRICS, CocoIds, coco_metrics, ground_truth, xywh
from stagectl.models.generate import Generation

EVAL_IOU = 0.5  # precision / recall / F1 use this IoU gate (COCO's AP50 threshold)
# per-image counters kept in each eval row, in this order (bootstrap intervals resample images)
PER_IMAGE_FIELDS = ("n_gt", "n_valid", "n_matched", "n_invalid", "n_truncated", "n_dup")


@dataclass(frozen=True)
class ImageOutcome:
    """One image's judged rollout."""

    index: int  # position of the sample in the evaluated set
    stats: RolloutStats
    predictions: list[dict[str, Any]]  # COCO results rows (image_id, category_id, bbox xywh px, score)
    num_unknown: int  # valid predictions whose desc is no known category (left out of `predictions`)
    parsed: list[dict[str, Any]] = field(default_factory=list)  # the kept objects: desc, bbox_2d, score
    token_ids: list[int] = field(default_factory=list)  # the rollout (to show it)


def judge_image(
    index: int,
    sample: DetectionSample,
    generation: Generation,
    vocab: TokenVocab,
    ids: CocoIds,
    *,
    duplicate_iou_threshold: float,
) -> ImageOutcome:
    """Parse, match and score one image's rollout (see the module docstring)."""
    parse, _, _, stats = judge_rollout(
        generation.token_ids, sample.objects, vocab, _gate(), duplicate_iou_threshold=duplicate_iou_threshold
    )
    scores = object_scores(parse, generation.logprobs)
    predictions, parsed, num_unknown = [], [], 0
    for obj, score in zip(parse.valid_objects, scores, strict=True):
        parsed.append({"desc": obj.desc, "bbox_2d": list(obj.bbox_2d), "score": score})
        category = ids.category_of_desc.get(obj.desc)
        if category is None:
            num_unknown += 1
            continue
        predictions.append(
            {
                "image_id": ids.image_ids[index],
                "category_id": category,
                "bbox": xywh(obj.bbox_2d, sample.width, sample.height),
                "score": score,
            }
        )
    return ImageOutcome(index, stats, predictions, num_unknown, parsed, list(generation.token_ids))


def _gate() -> RolloutMatchingConfig:
    return RolloutMatchingConfig(iou_gate=EVAL_IOU)


@dataclass(frozen=True)
class EvalReport:
    metrics: dict[str, Any]  # what metrics.json / an eval.jsonl row holds
    predictions: list[dict[str, Any]]  # COCO results, image order then object order
    ground_truth: dict[str, Any]  # the evaluated samples as a COCO instances dict
    per_image: list[list[int]]  # PER_IMAGE_FIELDS per image, image order


def summarize(
    samples: Sequence[DetectionSample], outcomes: Sequence[ImageOutcome], ids: CocoIds
) -> EvalReport:
    """Every image's outcome (any order, each image once) into one report."""
    ordered = sorted(outcomes, key=lambda o: o.index)
    if [o.index for o in ordered] != list(range(len(samples))):
        raise AssertionError("summarize: every image must be judged exactly once")
    stats = RolloutStats()
    for outcome in ordered:
        stats.add(outcome.stats)
    predictions = [row for outcome in ordered for row in outcome.predictions]
    gt = ground_truth(samples, ids)
    coco = coco_metrics(gt, predictions)
    num_unknown = sum(o.num_unknown for o in ordered)
    metrics: dict[str, Any] = {
        **{name: coco.summary[name] for name in COCO_METRICS},
        **f1_metrics(stats),
        "n_unknown_category": num_unknown,
        "unknown_category_rate": num_unknown / stats.n_valid if stats.n_valid else 0.0,
        "n_images": len(samples),
        "per_class_ap": coco.per_class_ap,
        "pr_curve_iou50": {"recall": coco.pr_recall, "precision": coco.pr_precision},
    }
    per_image = [[getattr(o.stats, name) for name in PER_IMAGE_FIELDS] for o in ordered]
    return EvalReport(metrics, predictions, gt, per_image)


def f1_metrics(stats: RolloutStats) -> dict[str, float]:
    """Precision / recall / F1 at IoU 0.5 (class-agnostic), invalid and duplicate rates, counts."""
    m = stats.metrics()
    return {
        "precision": m["rollout/precision"],
        "recall": m["rollout/recall"],
        "f1": m["rollout/f1"],
        "valid_json_rate": 1.0 - m["rollout/invalid_rate"] - m["rollout/parse_truncated_rate"],
        "invalid_rate": m["rollout/invalid_rate"] + m["rollout/parse_truncated_rate"],
        "dup_rate": m["rollout/dup_rate"],
        "n_dup": stats.n_dup,
        "n_samples": stats.n_samples,
        "n_gt": stats.n_gt,
        "n_pred": stats.n_valid,
        "n_matched": stats.n_matched,
        "n_dropped": stats.n_dropped,
    }
