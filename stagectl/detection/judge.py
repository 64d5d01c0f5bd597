"""Judging one rollout against its ground truth, on plain data: strict parse, match (Hungarian or greedy by
IoU, optionally desc-gated: `stage2_ab.channel_b.match`), duplicates and the rollout-quality counters.
Channel-B training and evaluation share it; evaluation matches by box alone (the default `MatchCosts`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stagectl.config.plan import MatchCosts
from stagectl.detection.dedup import find_duplicates
from stagectl.detection.matching import MatchResult, greedy_iou_match, hungarian_match
from stagectl.detection.parse import RolloutParse, parse_rollout
from stagectl.detection.serialize import BoxedObject
from stagectl.detection.stats import RolloutStats, sample_counters
from stagectl.detection.vocab import TokenVocab

BOX_ONLY = MatchCosts()  # Hungarian on boxes alone at the default IoU gate and costs


def match_objects(
    preds: Sequence[BoxedObject],
    gt: Sequence[BoxedObject],
    costs: MatchCosts = BOX_ONLY,
) -> MatchResult:
    """Match predicted to ground-truth objects with `costs`' IoU gate and costs, by `costs.assignment`;
    with `costs.desc_gated` only pairs of equal desc text may match."""
    allowed = None
    if costs.desc_gated:
        allowed = np.array([[p.desc == g.desc for g in gt] for p in preds], dtype=bool).reshape(
            len(preds), len(gt)
        )
    if costs.assignment == "hungarian":
        assign = hungarian_match
    elif costs.assignment == "greedy_iou":
        assign = greedy_iou_match
    else:
        raise ValueError(f"match.assignment must be hungarian or greedy_iou, got {costs.assignment!r}")
    return assign(
        [obj.bbox_2d for obj in preds],
        [obj.bbox_2d for obj in gt],
        iou_gate=costs.iou_gate,
        fp_cost=costs.fp_cost,
        fn_cost=costs.fn_cost,
        allowed=allowed,
    )


def judge_rollout(
    token_ids: Sequence[int],
    gt: Sequence[BoxedObject],
    vocab: TokenVocab,
    costs: MatchCosts = BOX_ONLY,
    *,
    duplicate_iou_threshold: float,
) -> tuple[RolloutParse, MatchResult, list[int], RolloutStats]:
    """Strict parse + match (`costs`) of one response (generated ids) against ground-truth objects, the
    indices of its duplicate predictions, and its counters (duplicates count as predictions: a matched
    one is a hit, else an FP)."""
    parse = parse_rollout(token_ids, vocab)
    match = match_objects(parse.valid_objects, gt, costs)
    duplicates = find_duplicates(parse.valid_objects, duplicate_iou_threshold)
    counters = sample_counters(parse, match, len(gt))
    stats = RolloutStats(
        n_samples=1,
        n_gt=counters.n_gt,
        n_valid=counters.n_valid_pred,
        n_dropped=counters.n_dropped,
        n_matched=counters.n_matched,
        n_fp=counters.n_fp,
        n_fn=counters.n_fn,
        n_truncated=int(parse.truncated),
        n_invalid=int(parse.not_json),
        n_rollout_tokens=len(token_ids),
        n_dup=len(duplicates),
    )
    return parse, match, duplicates, stats
