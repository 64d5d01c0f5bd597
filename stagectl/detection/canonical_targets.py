"""Channel-B targets written fresh as canonical text, not on the rollout's own tokens (those are
`targets.build_channel_b_segment`, `target: raw_prefix`). Segments, weights and groups as `targets`
documents them.

Clean prefix (`build_channel_b_clean_segment`, `stage2_ab.channel_b.target: clean_prefix`): the canonical
text of the matched predictions (rollout order) + the FN objects, written fresh; FP, duplicate and
invalid predictions are not in it (neither input nor target). Weights as for the raw prefix.
Reordered GT (`build_channel_b_reordered_gt_segment`, `target: reordered_gt`): the canonical text of the
matched GT objects (GT desc, GT box) in the order of the predictions that found them + the FN objects;
structure CE 1, matched descs as `targets.matched_desc` gives but always written as the GT desc, FN descs
`desc_ce_weight`, every box a group toward its own (written) bins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stagectl.config.plan import TargetPlan
from stagectl.detection.matching import MatchResult
from stagectl.detection.serialize import BoxedObject, serialize_in_order_with_desc_spans, sort_objects
from stagectl.detection.targets import (
    CoordGroup,
    Encode,
    Segment,
    box_bins,
    check_match,
    coord_groups,
    desc_weighted,
    encode_checked,
    matched_desc,
    missed_desc_weight,
)
from stagectl.detection.vocab import TokenVocab


@dataclass(frozen=True)
class _CleanEntry:
    """One object of a clean-prefix target: what is written (desc, box), what its box is pulled toward."""

    desc: str
    bbox_2d: tuple[int, int, int, int]  # written bins (the prediction's own box for a kept object)
    gt_bins: tuple[int, int, int, int]
    desc_weight: float


def _serialized_segment(entries: Sequence[_CleanEntry], encode: Encode, vocab: TokenVocab) -> Segment:
    """Canonical text of `entries` in the given order (keys object_1..N) + end-of-turn: structure CE 1,
    each desc its entry's weight, each box a group toward its entry's `gt_bins`."""
    text, desc_spans = serialize_in_order_with_desc_spans(entries)
    ids = encode_checked(text, encode, vocab)
    weights = desc_weighted(ids, vocab, desc_spans, [e.desc_weight for e in entries])
    groups = [
        CoordGroup(group.positions, entry.gt_bins)
        for group, entry in zip(coord_groups(ids, 0, entries, vocab), entries, strict=True)
    ]
    for group in groups:
        for position in group.positions:
            weights[position] = 0.0
    return Segment(
        channel="B", input_ids=[*ids, vocab.end_of_turn_id], ce_weights=[*weights, 1.0], coord_groups=groups
    )


def _missed_entries(
    match: MatchResult, gt_objects: Sequence[BoxedObject], target: TargetPlan
) -> list[_CleanEntry]:
    desc_ce_weight = missed_desc_weight(target)
    return [
        _CleanEntry(g.desc, box_bins(g), box_bins(g), desc_ce_weight)
        for g in sort_objects([gt_objects[j] for j in match.fn])
    ]


def build_channel_b_clean_segment(
    accepted: Sequence[BoxedObject],
    match: MatchResult,
    gt_objects: Sequence[BoxedObject],
    *,
    encode: Encode,
    vocab: TokenVocab,
    target: TargetPlan,
) -> Segment:
    """The clean-prefix target: canonical text of the matched predictions + the missed GT + end-of-turn.

    `accepted` are the rollout's valid, non-duplicate predictions in rollout order and `match` pairs their
    indices with indices of `gt_objects`. FP (unmatched) predictions, duplicates and invalid entries are
    not in the text at all, so no token of theirs is input or target. Kept (matched) objects are written
    with their own box and the desc `matched_desc` gives (their own with CE 0 unless
    `target.desc_ce_weight_matched` > 0): structure CE 1, coordinate slots -> a group toward the matched
    GT. Missed GT: desc CE `target.desc_ce_weight_missed`, coordinate slots -> a group toward itself.
    `target.insertion_order`: `tail_append`: kept objects in rollout order, then the missed ones sorted;
    `sorted`: all in answer order. Keys object_1..N.
    """
    check_match(match, len(accepted), len(gt_objects), "accepted")
    missed = _missed_entries(match, gt_objects, target)
    kept = []
    for i, j in sorted(match.pairs):
        desc, weight = matched_desc(
            accepted[i].desc,
            gt_objects[j].desc,
            weight=target.desc_ce_weight_matched,
            mask_correct=target.mask_correct_matched_desc,
            always_gt=False,
        )
        kept.append(_CleanEntry(desc, box_bins(accepted[i]), box_bins(gt_objects[j]), weight))
    if target.insertion_order == "tail_append":
        entries = kept + missed
    elif target.insertion_order == "sorted":
        entries = sort_objects(kept + missed)
    else:
        raise ValueError(f"insertion_order must be tail_append or sorted, got {target.insertion_order!r}")
    return _serialized_segment(entries, encode, vocab)


def build_channel_b_reordered_gt_segment(
    accepted: Sequence[BoxedObject],
    match: MatchResult,
    gt_objects: Sequence[BoxedObject],
    *,
    encode: Encode,
    vocab: TokenVocab,
    target: TargetPlan,
) -> Segment:
    """The reordered-GT target (the async design seed's `y_train_ids`): the GT objects the rollout found,
    each written with its GT desc and GT box in the order of the predictions that found them, then the
    missed GT sorted, + end-of-turn. Nothing of the rollout's own text is in it; the rollout decides only
    the order and which descs carry CE. Structure CE 1; a matched desc `target.desc_ce_weight_matched` (0
    where the prediction's desc was already right under `target.mask_correct_matched_desc`); a missed desc
    `target.desc_ce_weight_missed`; every box a group toward its own bins. `accepted` / `match` as for the clean prefix.
    """
    check_match(match, len(accepted), len(gt_objects), "accepted")
    missed = _missed_entries(match, gt_objects, target)
    found = []
    for i, j in sorted(match.pairs):
        gt = gt_objects[j]
        desc, weight = matched_desc(
            accepted[i].desc,
            gt.desc,
            weight=target.desc_ce_weight_matched,
            mask_correct=target.mask_correct_matched_desc,
            always_gt=True,
        )
        found.append(_CleanEntry(desc, box_bins(gt), box_bins(gt), weight))
    return _serialized_segment(found + missed, encode, vocab)
