"""The evaluation core, on plain data: each image's rollout judged (strict parse, Hungarian match at IoU
0.5, duplicates, per-object scores, COCO results rows), then every image summed into one metrics dict:
class-aware COCO bbox metrics (and a per-class AP table), class-agnostic AP (COCOeval's own
`useCats = 0`), the AP every score kind would give and the AP with every score 1 (what the score is
worth), box-only precision / recall / F1, desc accuracy on matched pairs and the desc-aware
precision / recall / F1 (`evaluation.labels`), the predicted-desc histogram, how the answers ended
(valid JSON, truncated, not JSON) and the duplicate rate.

Per-image outcomes are plain data so ranks can evaluate shards and rank 0 can merge them in image order:
the merged metrics are then those of one rank over all images.

Predictions whose `desc` is no category of the ground truth (an open-vocabulary model naming something
else) cannot be scored by COCO's class-aware evaluator: they are left out of `predictions.coco.json`
(`unknown_predictions`: `predictions.unknown_category.json`) and counted (`n_unknown_category`,
`unknown_category_rate` of valid predictions). They count wherever labels do not: the class-agnostic AP
(a box with a misnamed label is still a box found, or a false positive) and precision / recall / F1, whose
matching is class-agnostic, as in training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from stagectl.config.plan import MatchCosts
from stagectl.data.sample import DetectionSample
from stagectl.detection.judge import judge_rollout
from stagectl.detection.scores import (
    DEFAULT_SCORE,
    SCORE_KINDS,
    ObjectConfidence,
    ScoreKind,
    object_confidences,
)
from stagectl.detection.stats import RolloutStats
from stagectl.detection.vocab import TokenVocab
from stagectl.evaluation.coco import (
    COCO_METRICS,
    CocoIds,
    agnostic_results,
    coco_metrics,
    coco_summary,
    ground_truth,
    xywh,
)
from stagectl.evaluation.labels import desc_histogram, label_metrics, matched_desc_count
from stagectl.models.generate import Generation

EVAL_IOU = 0.5  # precision / recall / F1 use this IoU gate (COCO's AP50 threshold)
EVAL_MATCH = MatchCosts(iou_gate=EVAL_IOU)  # Hungarian on boxes alone at that gate
# per-image counters kept in each eval row, in this order (bootstrap intervals resample images)
PER_IMAGE_FIELDS = ("n_gt", "n_valid", "n_matched", "n_invalid", "n_truncated", "n_dup", "n_matched_desc")
AGNOSTIC_METRICS = ("AP", "AP50", "AP75", "AR100")  # written with an `_agnostic` suffix


@dataclass(frozen=True)
class ImageOutcome:
    """One image's judged rollout."""

    index: int  # position of the sample in the evaluated set
    stats: RolloutStats
    predictions: list[dict[str, Any]]  # COCO results rows (image_id, category_id, bbox xywh px, score)
    num_unknown: int  # valid predictions whose desc is no known category (left out of `predictions`)
    parsed: list[dict[str, Any]] = field(default_factory=list)  # the kept objects: desc, bbox_2d, score(s)
    token_ids: list[int] = field(default_factory=list)  # the rollout (to show it)
    confidences: list[ObjectConfidence] = field(default_factory=list)  # one per row of `predictions`
    num_matched_desc: int = 0  # matched pairs (box-only matching) whose desc is the ground truth's
    pred_descs: list[str] = field(default_factory=list)  # every valid prediction's desc, in order
    # the `num_unknown` predictions as COCO results rows without a category (image_id, bbox, score, desc):
    # the class-agnostic AP scores them
    unknown_predictions: list[dict[str, Any]] = field(default_factory=list)


def judge_image(
    index: int,
    sample: DetectionSample,
    generation: Generation,
    vocab: TokenVocab,
    ids: CocoIds,
    *,
    duplicate_iou_threshold: float,
    score: ScoreKind = DEFAULT_SCORE,
) -> ImageOutcome:
    """Parse, match and score (`score`: `detection.scores`) one image's rollout (see the module docstring)."""
    parse, match, _, stats = judge_rollout(
        generation.token_ids,
        sample.objects,
        vocab,
        EVAL_MATCH,
        duplicate_iou_threshold=duplicate_iou_threshold,
    )
    predictions, parsed, kept, unknown = [], [], [], []
    for obj, conf in zip(parse.valid_objects, object_confidences(parse, generation.logprobs), strict=True):
        by_kind = {kind: conf.score(kind) for kind in SCORE_KINDS}
        parsed.append(
            {"desc": obj.desc, "bbox_2d": list(obj.bbox_2d), "score": by_kind[score], "scores": by_kind}
        )
        row = {
            "image_id": ids.image_ids[index],
            "bbox": xywh(obj.bbox_2d, sample.width, sample.height),
            "score": by_kind[score],
        }
        category = ids.category_of_desc.get(obj.desc)
        if category is None:
            unknown.append({**row, "desc": obj.desc})
            continue
        predictions.append({"image_id": row["image_id"], "category_id": category, **row})
        kept.append(conf)
    return ImageOutcome(
        index,
        stats,
        predictions,
        len(unknown),
        parsed,
        list(generation.token_ids),
        confidences=kept,
        num_matched_desc=matched_desc_count(parse.valid_objects, sample.objects, match),
        pred_descs=[obj.desc for obj in parse.valid_objects],
        unknown_predictions=unknown,
    )


@dataclass(frozen=True)
class EvalReport:
    metrics: dict[str, Any]  # what metrics.json / an eval.jsonl row holds
    predictions: list[dict[str, Any]]  # COCO results, image order then object order
    ground_truth: dict[str, Any]  # the evaluated samples as a COCO instances dict
    per_image: list[list[int]]  # PER_IMAGE_FIELDS per image, image order
    # the predictions whose desc is no category, without one (`ImageOutcome.unknown_predictions`), image order
    unknown_predictions: list[dict[str, Any]] = field(default_factory=list)


def summarize(
    samples: Sequence[DetectionSample],
    outcomes: Sequence[ImageOutcome],
    ids: CocoIds,
    score: ScoreKind = DEFAULT_SCORE,
) -> EvalReport:
    """Every image's outcome (any order, each image once; judged with `score`) into one report."""
    ordered = sorted(outcomes, key=lambda o: o.index)
    if [o.index for o in ordered] != list(range(len(samples))):
        raise AssertionError("summarize: every image must be judged exactly once")
    stats = RolloutStats()
    for outcome in ordered:
        stats.add(outcome.stats)
    predictions = [row for outcome in ordered for row in outcome.predictions]
    gt = ground_truth(samples, ids)
    coco = coco_metrics(gt, predictions)
    unknown = [row for outcome in ordered for row in outcome.unknown_predictions]
    agnostic = coco_summary(gt, agnostic_results(gt, predictions, unknown), use_cats=False)
    num_unknown = sum(o.num_unknown for o in ordered)
    num_matched_desc = sum(o.num_matched_desc for o in ordered)
    metrics: dict[str, Any] = {
        **{name: coco.summary[name] for name in COCO_METRICS},
        **{f"{name}_agnostic": agnostic[name] for name in AGNOSTIC_METRICS},
        **score_metrics(gt, ordered, score, scored_ap=coco.summary["AP"]),
        **f1_metrics(stats),
        **label_metrics(num_matched_desc, stats.n_matched, stats.n_valid, stats.n_gt),
        **desc_histogram(
            (d for o in ordered for d in o.pred_descs), (obj.desc for s in samples for obj in s.objects)
        ),
        "n_unknown_category": num_unknown,
        "unknown_category_rate": num_unknown / stats.n_valid if stats.n_valid else 0.0,
        "n_images": len(samples),
        "per_class_ap": coco.per_class_ap,
        "pr_curve_iou50": {"recall": coco.pr_recall, "precision": coco.pr_precision},
    }
    per_image = [
        [
            o.num_matched_desc if name == "n_matched_desc" else getattr(o.stats, name)
            for name in PER_IMAGE_FIELDS
        ]
        for o in ordered
    ]
    return EvalReport(metrics, predictions, gt, per_image, unknown)


def score_metrics(
    gt: dict[str, Any], ordered: Sequence[ImageOutcome], score: ScoreKind, *, scored_ap: float
) -> dict[str, Any]:
    """The score used, the class-aware AP with every score 1 (`AP_constant_score`: objects ranked in answer
    order) and the AP each score kind gives (`AP_by_score`, `constant` included): the same predictions,
    re-ranked."""

    def ap_with(score_of: Callable[[ObjectConfidence], float]) -> float:
        rows = [
            {**row, "score": score_of(conf)}
            for o in ordered
            for row, conf in zip(o.predictions, o.confidences, strict=True)
        ]
        return coco_summary(gt, rows)["AP"]

    by_kind: dict[str, float] = {
        kind: scored_ap if kind == score else ap_with(partial(ObjectConfidence.score, kind=kind))
        for kind in SCORE_KINDS
    }
    by_kind["constant"] = ap_with(lambda _: 1.0)
    return {"score": score, "AP_constant_score": by_kind["constant"], "AP_by_score": by_kind}


def answer_rates(stats: RolloutStats) -> dict[str, float]:
    """How the answers ended, as shares of the images (`RolloutParse`: each answer is exactly one of closed,
    truncated, not JSON): `valid_json_rate` closed as one JSON object; `invalid_rate` the rest (so
    `valid_json_rate + invalid_rate == 1`; upstream counts both kinds as truncated); `truncated_rate` the
    part of `invalid_rate` cut off before the object closed (the rest had no `{` or a syntax error)."""
    if not stats.n_samples:
        return {"valid_json_rate": 0.0, "invalid_rate": 0.0, "truncated_rate": 0.0}
    not_closed = stats.n_invalid + stats.n_truncated
    return {
        "valid_json_rate": (stats.n_samples - not_closed) / stats.n_samples,
        "invalid_rate": not_closed / stats.n_samples,
        "truncated_rate": stats.n_truncated / stats.n_samples,
    }


def f1_metrics(stats: RolloutStats) -> dict[str, float]:
    """Box-only precision / recall / F1 at IoU 0.5 (desc ignored; `precision` / `recall` / `f1` and the
    same numbers as `*_box`), how the answers ended (`answer_rates`), the duplicate rate, counts."""
    m = stats.metrics()
    return {
        "precision": m["rollout/precision"],
        "recall": m["rollout/recall"],
        "f1": m["rollout/f1"],
        "precision_box": m["rollout/precision"],
        "recall_box": m["rollout/recall"],
        "f1_box": m["rollout/f1"],
        **answer_rates(stats),
        "dup_rate": m["rollout/dup_rate"],
        "n_dup": stats.n_dup,
        "n_samples": stats.n_samples,
        "n_gt": stats.n_gt,
        "n_pred": stats.n_valid,
        "n_matched": stats.n_matched,
        "n_dropped": stats.n_dropped,
        "mean_rollout_tokens": stats.n_rollout_tokens / stats.n_samples if stats.n_samples else 0.0,
    }
