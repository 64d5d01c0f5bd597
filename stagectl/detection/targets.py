"""Teacher-forced target segments for Channel-A and Channel-B, as plain lists.

A `Segment` is the ASSISTANT part of one training sequence (the caller prepends the prompt):
`input_ids`, one CE weight per token and the coordinate groups.

Weight convention: `ce_weights[i]` scales the cross-entropy of predicting `input_ids[i]` (from the
logits at position i - 1 of the full sequence; the prompt's last token predicts `input_ids[0]`).
0 means masked. Coordinate slots always have CE weight 0 here: their loss (geometry toward the GT
box and, if enabled, coordinate CE with weight `coord_ce_weight`) comes from `coord_groups`, each
4 token positions (x1, y1, x2, y2) into `input_ids` plus the 4 GT bins they are supervised toward.

Channel-A: `encode(serialize_objects(gt)) + [end-of-turn]`; CE 1 on every non-coordinate token.

Channel-B: `parse.prefix_token_ids + encode(append_fragment(FN objects)) + [end-of-turn]`.
- Prefix tokens default to CE 1 (the `{`, separators, keys, brackets).
- Matched prefix object: desc tokens 0 (desc CE off), coordinate slots -> a group toward the matched GT.
- FP object and dropped (invalid) entry: every token of its span 0 (fully masked), no group.
- FN tail: CE 1, desc tokens `desc_ce_weight` (a token overlapping the desc text counts as desc),
  coordinate slots -> a group toward that GT.
- The closing `}` and the end-of-turn: CE 1.
Channel-B clean prefix (`build_channel_b_clean_segment`, `stage2_ab.channel_b.target: clean_prefix`):
the canonical text of the matched predictions (rollout order) + the FN objects, written fresh; FP,
duplicate and invalid predictions are not in it (neither input nor target). Weights as above.
In the prefix, a token shared by two regions (a fused `"]},` at an entry boundary) takes the smallest
weight any of them gives it, so a masked region never leaks CE into a neighbour.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

from stagectl.detection.matching import MatchResult
from stagectl.detection.parse import RolloutParse
from stagectl.detection.serialize import (
    BoxedObject,
    append_fragment_with_desc_spans,
    serialize_in_order_with_desc_spans,
    serialize_objects,
    sort_objects,
)
from stagectl.detection.vocab import TokenVocab

Encode = Callable[[str], Sequence[int]]  # text -> token ids, no special tokens added


@dataclass(frozen=True)
class CoordGroup:
    positions: tuple[int, int, int, int]  # token indices into Segment.input_ids: x1, y1, x2, y2
    gt_bins: tuple[int, int, int, int]


@dataclass(frozen=True)
class Segment:
    channel: Literal["A", "B"]
    input_ids: list[int]  # [T] assistant tokens, end-of-turn last
    ce_weights: list[float]  # [T]
    coord_groups: list[CoordGroup]


@dataclass(frozen=True)
class SampleCounters:
    """Per-sample rollout quality. An empty denominator gives 1.0 when the other side is empty too
    (nothing to find, nothing found), else 0.0. Aggregate across samples by summing the counts."""

    n_gt: int
    n_valid_pred: int
    n_dropped: int
    n_matched: int
    n_fp: int
    n_fn: int
    precision: float
    recall: float


def _coord_groups(
    ids: Sequence[int], offset: int, objects: Sequence[BoxedObject], vocab: TokenVocab
) -> list[CoordGroup]:
    """Groups for `objects` (in answer order) from the coordinate tokens of `ids` (positions + offset)."""
    bin_of_id = vocab.coords.bin_of_id
    positions = [k for k, token_id in enumerate(ids) if token_id in bin_of_id]
    if len(positions) != 4 * len(objects):
        raise ValueError(
            f"encode() produced {len(positions)} coordinate tokens for {len(objects)} objects; "
            "the tokenizer must hold <|coord_0|>..<|coord_999|> as single tokens"
        )
    groups = []
    for k, obj in enumerate(objects):
        p = positions[4 * k : 4 * k + 4]
        x1, y1, x2, y2 = (int(b) for b in obj.bbox_2d)
        if [bin_of_id[ids[q]] for q in p] != [x1, y1, x2, y2]:
            raise ValueError("encode() and the vocabulary disagree on coordinate tokens")
        groups.append(
            CoordGroup((p[0] + offset, p[1] + offset, p[2] + offset, p[3] + offset), (x1, y1, x2, y2))
        )
    return groups


def build_channel_a_segment(
    gt_objects: Sequence[BoxedObject], *, encode: Encode, vocab: TokenVocab
) -> Segment:
    """Plain teacher forcing on the GT answer."""
    ids = [*encode(serialize_objects(gt_objects)), vocab.end_of_turn_id]
    groups = _coord_groups(ids, 0, sort_objects(gt_objects), vocab)
    weights = [1.0] * len(ids)
    for group in groups:
        for position in group.positions:
            weights[position] = 0.0
    return Segment(channel="A", input_ids=ids, ce_weights=weights, coord_groups=groups)


def _encode_checked(text: str, encode: Encode, vocab: TokenVocab) -> list[int]:
    ids = list(encode(text))
    if b"".join(vocab.token_bytes[t] for t in ids) != text.encode("utf-8"):
        raise ValueError("encode() and the vocabulary's token bytes disagree on a target fragment")
    return ids


def _desc_weighted(
    ids: Sequence[int],
    vocab: TokenVocab,
    desc_spans: Sequence[tuple[int, int]],
    desc_weights: Sequence[float],
) -> list[float]:
    """CE 1 everywhere except tokens overlapping a desc byte span, which take that desc's weight."""
    starts = list(accumulate((len(vocab.token_bytes[t]) for t in ids), initial=0))  # [len(ids) + 1]
    weights = [1.0] * len(ids)
    for (start, end), weight in zip(desc_spans, desc_weights, strict=True):
        first, stop = bisect_right(starts, start) - 1, bisect_left(starts, end)
        for k in range(first, stop):
            weights[k] = weight
    return weights


def _mask(weights: list[float], span: tuple[int, int], value: float) -> None:
    for i in range(span[0], span[1]):
        weights[i] = min(weights[i], value)


def build_channel_b_segment(
    parse: RolloutParse,
    match: MatchResult,
    gt_objects: Sequence[BoxedObject],
    *,
    encode: Encode,
    vocab: TokenVocab,
    desc_ce_weight: float,
) -> Segment:
    """Rollout prefix + FN append + end-of-turn. `match` pairs indices of `parse.valid_objects` with
    indices of `gt_objects`."""
    num_pred, num_gt = len(parse.valid_objects), len(gt_objects)
    if any(not (0 <= i < num_pred and 0 <= j < num_gt) for i, j in match.pairs) or any(
        not 0 <= j < num_gt for j in match.fn
    ):
        raise ValueError("match indices do not fit parse.valid_objects / gt_objects")
    if desc_ce_weight < 0:
        raise ValueError(f"desc_ce_weight must be >= 0, got {desc_ce_weight}")

    prefix = list(parse.prefix_token_ids)
    weights = [1.0] * len(prefix)
    groups: list[CoordGroup] = []
    gt_of_pred = dict(match.pairs)
    for i, obj in enumerate(parse.valid_objects):
        j = gt_of_pred.get(i)
        if j is None:  # FP
            _mask(weights, obj.token_span, 0.0)
            continue
        _mask(weights, obj.desc_token_span, 0.0)
        for position in obj.coord_positions:
            weights[position] = 0.0
        x1, y1, x2, y2 = (int(b) for b in gt_objects[j].bbox_2d)
        groups.append(CoordGroup(obj.coord_positions, (x1, y1, x2, y2)))
    for dropped in parse.dropped_objects:
        _mask(weights, dropped.token_span, 0.0)

    fn_objects = sort_objects([gt_objects[j] for j in match.fn])
    fragment, desc_spans = append_fragment_with_desc_spans(
        fn_objects, max_object_index=parse.max_object_index, prefix_has_entries=parse.prefix_has_entries
    )
    tail = _encode_checked(fragment, encode, vocab)
    tail_weights = _desc_weighted(tail, vocab, desc_spans, [desc_ce_weight] * len(desc_spans))
    tail_groups = _coord_groups(tail, len(prefix), fn_objects, vocab)
    for group in tail_groups:
        for position in group.positions:
            tail_weights[position - len(prefix)] = 0.0

    return Segment(
        channel="B",
        input_ids=[*prefix, *tail, vocab.end_of_turn_id],
        ce_weights=[*weights, *tail_weights, 1.0],
        coord_groups=groups + tail_groups,
    )


@dataclass(frozen=True)
class _CleanEntry:
    """One object of a clean-prefix target: what is written (desc, box), what its box is pulled toward."""

    desc: str
    bbox_2d: tuple[int, int, int, int]  # written bins (the prediction's own box for a kept object)
    gt_bins: tuple[int, int, int, int]
    desc_weight: float


def _bins(obj: BoxedObject) -> tuple[int, int, int, int]:
    x1, y1, x2, y2 = (int(b) for b in obj.bbox_2d)
    return (x1, y1, x2, y2)


def build_channel_b_clean_segment(
    accepted: Sequence[BoxedObject],
    match: MatchResult,
    gt_objects: Sequence[BoxedObject],
    *,
    encode: Encode,
    vocab: TokenVocab,
    desc_ce_weight: float,
    insertion_order: Literal["tail_append", "sorted"],
) -> Segment:
    """The clean-prefix target: canonical text of the matched predictions + the missed GT + end-of-turn.

    `accepted` are the rollout's valid, non-duplicate predictions in rollout order and `match` pairs their
    indices with indices of `gt_objects`. FP (unmatched) predictions, duplicates and invalid entries are
    not in the text at all, so no token of theirs is input or target. Kept (matched) objects are written
    with their own desc and box: structure CE 1, desc CE 0, coordinate slots -> a group toward the matched
    GT. Missed GT: desc CE `desc_ce_weight`, coordinate slots -> a group toward itself. `tail_append`: kept
    objects in rollout order, then the missed ones sorted; `sorted`: all in answer order. Keys object_1..N.
    """
    num_pred, num_gt = len(accepted), len(gt_objects)
    if any(not (0 <= i < num_pred and 0 <= j < num_gt) for i, j in match.pairs) or any(
        not 0 <= j < num_gt for j in match.fn
    ):
        raise ValueError("match indices do not fit accepted / gt_objects")
    if desc_ce_weight < 0:
        raise ValueError(f"desc_ce_weight must be >= 0, got {desc_ce_weight}")
    kept = [
        _CleanEntry(accepted[i].desc, _bins(accepted[i]), _bins(gt_objects[j]), 0.0)
        for i, j in sorted(match.pairs)
    ]
    missed = [
        _CleanEntry(g.desc, _bins(g), _bins(g), desc_ce_weight)
        for g in sort_objects([gt_objects[j] for j in match.fn])
    ]
    if insertion_order == "tail_append":
        entries = kept + missed
    elif insertion_order == "sorted":
        entries = sort_objects(kept + missed)
    else:
        raise ValueError(f"insertion_order must be tail_append or sorted, got {insertion_order!r}")

    text, desc_spans = serialize_in_order_with_desc_spans(entries)
    ids = _encode_checked(text, encode, vocab)
    weights = _desc_weighted(ids, vocab, desc_spans, [e.desc_weight for e in entries])
    groups = [
        CoordGroup(group.positions, entry.gt_bins)
        for group, entry in zip(_coord_groups(ids, 0, entries, vocab), entries, strict=True)
    ]
    for group in groups:
        for position in group.positions:
            weights[position] = 0.0
    return Segment(
        channel="B", input_ids=[*ids, vocab.end_of_turn_id], ce_weights=[*weights, 1.0], coord_groups=groups
    )


def _ratio(num: int, den: int, other_side_empty: bool) -> float:
    if den:
        return num / den
    return 1.0 if other_side_empty else 0.0


def sample_counters(parse: RolloutParse, match: MatchResult, num_gt: int) -> SampleCounters:
    """Rollout quality of one sample from its parse and match."""
    n_valid = len(parse.valid_objects)
    n_matched = len(match.pairs)
    return SampleCounters(
        n_gt=num_gt,
        n_valid_pred=n_valid,
        n_dropped=parse.dropped_total,
        n_matched=n_matched,
        n_fp=len(match.fp),
        n_fn=len(match.fn),
        precision=_ratio(n_matched, n_valid, num_gt == 0),
        recall=_ratio(n_matched, num_gt, n_valid == 0),
    )
