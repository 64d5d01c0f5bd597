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
  Matched-desc supervision (`desc_ce_weight_matched` > 0): a matched object whose desc differs from its
  GT's has its desc tokens replaced by the encoded GT desc (the tokens from the one before the desc to the
  one after it are re-encoded; later positions shift), those tokens weighted `desc_ce_weight_matched`; one
  whose desc is already right keeps its tokens with CE 0 (or `desc_ce_weight_matched` when
  `mask_correct_matched_desc` is false).
- FP object and dropped (invalid) entry: every token of its span 0 (fully masked), no group.
- FN tail: CE 1, desc tokens `desc_ce_weight` (a token overlapping the desc text counts as desc),
  coordinate slots -> a group toward that GT.
- The closing `}` and the end-of-turn: CE 1.
The Channel-B targets written fresh as canonical text (`clean_prefix`, `reordered_gt`) are
`canonical_targets`; they share this module's `Segment`, token checks and desc rule (`matched_desc`).
In the prefix, a token shared by two regions (a fused `"]},` at an entry boundary) takes the smallest
weight any of them gives it, so a masked region never leaks CE into a neighbour (also where a desc
re-encode splits such a token: its bytes keep the masks of the entries they belong to).
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

from stagectl.config.plan import TargetPlan
from stagectl.detection.matching import MatchResult
from stagectl.detection.parse import ParsedObject, RolloutParse
from stagectl.detection.serialize import (
    BoxedObject,
    append_fragment_with_desc_spans,
    serialize_objects,
    sort_objects,
)
from stagectl.detection.vocab import TokenVocab

Encode = Callable[[str], Sequence[int]]  # text -> token ids, no special tokens added


@dataclass(frozen=True)
class CoordGroup:
    """One box: the positions of its 4 coordinate tokens (x1, y1, x2, y2) in a segment's `input_ids` and
    their GT bins (0..999). A target segment's positions index its assistant tokens; a
    `collate.Segment`'s (the same class) index the whole sequence, prompt included."""

    positions: tuple[int, int, int, int]
    gt_bins: tuple[int, int, int, int]


@dataclass(frozen=True)
class Segment:
    channel: Literal["A", "B"]
    input_ids: list[int]  # [T] assistant tokens, end-of-turn last
    ce_weights: list[float]  # [T]
    coord_groups: list[CoordGroup]


def coord_groups(
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


def box_bins(obj: BoxedObject) -> tuple[int, int, int, int]:
    """`obj`'s box as 4 integer bins."""
    x1, y1, x2, y2 = (int(b) for b in obj.bbox_2d)
    return (x1, y1, x2, y2)


def check_match(match: MatchResult, num_pred: int, num_gt: int, what: str) -> None:
    """Every index of `match` fits its side (`num_pred` predictions, named `what`; `num_gt` GT objects)."""
    if any(not (0 <= i < num_pred and 0 <= j < num_gt) for i, j in match.pairs) or any(
        not 0 <= j < num_gt for j in match.fn
    ):
        raise ValueError(f"match indices do not fit {what} / gt_objects")


def missed_desc_weight(target: TargetPlan) -> float:
    """The CE weight of a missed (FN) object's desc tokens, checked."""
    if target.desc_ce_weight_missed < 0:
        raise ValueError(f"desc_ce_weight must be >= 0, got {target.desc_ce_weight_missed}")
    return target.desc_ce_weight_missed


def build_channel_a_segment(
    gt_objects: Sequence[BoxedObject], *, encode: Encode, vocab: TokenVocab
) -> Segment:
    """Plain teacher forcing on the GT answer."""
    ids = [*encode(serialize_objects(gt_objects)), vocab.end_of_turn_id]
    groups = coord_groups(ids, 0, sort_objects(gt_objects), vocab)
    weights = [1.0] * len(ids)
    for group in groups:
        for position in group.positions:
            weights[position] = 0.0
    return Segment(channel="A", input_ids=ids, ce_weights=weights, coord_groups=groups)


def encode_checked(text: str, encode: Encode, vocab: TokenVocab) -> list[int]:
    ids = list(encode(text))
    if b"".join(vocab.token_bytes[t] for t in ids) != text.encode("utf-8"):
        raise ValueError("encode() and the vocabulary's token bytes disagree on a target fragment")
    return ids


def desc_weighted(
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


def matched_desc(
    pred_desc: str, gt_desc: str, *, weight: float, mask_correct: bool, always_gt: bool
) -> tuple[str, float]:
    """(the desc a matched object is written with, its CE weight). Right already: the GT desc (the same
    text), CE 0 under `mask_correct`, else `weight`. Wrong: the GT desc with `weight` when `always_gt`
    (reordered GT) or `weight` > 0; otherwise the prediction's own desc with CE 0 (no label signal)."""
    if weight < 0:
        raise ValueError(f"desc_ce_weight_matched must be >= 0, got {weight}")
    if pred_desc == gt_desc:
        return gt_desc, 0.0 if mask_correct else weight
    if always_gt or weight > 0:
        return gt_desc, weight
    return pred_desc, 0.0


@dataclass(frozen=True)
class _Splice:
    """Prefix tokens [start, stop) replaced by `ids` with `weights`."""

    start: int
    stop: int
    ids: list[int]
    weights: list[float]


def _desc_splice(
    obj: ParsedObject,
    desc: str,
    weight: float,
    prefix_bytes: bytes,
    starts: Sequence[int],
    encode: Encode,
    vocab: TokenVocab,
    neighbour_weights: Sequence[float],
) -> _Splice:
    """Re-encode the tokens overlapping `obj`'s desc with `desc` written in its place (JSON-escaped, as the
    serializer writes it); the new desc tokens take `weight`, the structure bytes they carry CE 1, capped
    by the weight the other entries' masks gave the token those bytes came from (`neighbour_weights`): a
    `"}, "` fused into the desc's last token that reaches into a masked FP entry stays masked after the
    re-encode, as the smallest-weight rule keeps it without one."""
    first, stop = obj.desc_token_span
    desc_start, desc_end = obj.desc_bytes
    escaped = json.dumps(desc, ensure_ascii=False)[1:-1].encode("utf-8")
    head = prefix_bytes[starts[first] : desc_start]  # e.g. `"` or `": "` fused into the first desc token
    tail = prefix_bytes[desc_end : starts[stop]]  # e.g. `"` or `", ` fused into the last desc token
    ids = encode_checked((head + escaped + tail).decode("utf-8"), encode, vocab)
    desc_stop = len(head) + len(escaped)
    weights = desc_weighted(ids, vocab, [(len(head), desc_stop)], [weight])
    # head bytes all come from token `first`, tail bytes from token `stop - 1`
    new_starts = list(accumulate((len(vocab.token_bytes[t]) for t in ids), initial=0))  # [len(ids) + 1]
    for k in range(len(ids)):
        if new_starts[k] < len(head):
            weights[k] = min(weights[k], neighbour_weights[first])
        if new_starts[k + 1] > desc_stop:
            weights[k] = min(weights[k], neighbour_weights[stop - 1])
    return _Splice(first, stop, ids, weights)


def build_channel_b_segment(
    parse: RolloutParse,
    match: MatchResult,
    gt_objects: Sequence[BoxedObject],
    *,
    encode: Encode,
    vocab: TokenVocab,
    target: TargetPlan,
) -> Segment:
    """Rollout prefix + FN append + end-of-turn. `match` pairs indices of `parse.valid_objects` with
    indices of `gt_objects`; matched descs per `matched_desc` (module docstring); the desc weights are
    `target`'s."""
    check_match(match, len(parse.valid_objects), len(gt_objects), "parse.valid_objects")
    desc_ce_weight = missed_desc_weight(target)

    prefix = list(parse.prefix_token_ids)
    starts = list(accumulate((len(vocab.token_bytes[t]) for t in prefix), initial=0))  # [len(prefix) + 1]
    prefix_bytes = b"".join(vocab.token_bytes[t] for t in prefix)
    weights = [1.0] * len(prefix)
    gt_of_pred = dict(match.pairs)
    # first the masked entries (FP, dropped), so a matched desc's weights see every neighbour's mask
    for i, obj in enumerate(parse.valid_objects):
        if i not in gt_of_pred:  # FP
            _mask(weights, obj.token_span, 0.0)
    for dropped in parse.dropped_objects:
        _mask(weights, dropped.token_span, 0.0)
    neighbour_weights = list(weights)
    matched: list[tuple[ParsedObject, tuple[int, int, int, int]]] = []
    splices: list[_Splice] = []
    for i, obj in enumerate(parse.valid_objects):
        j = gt_of_pred.get(i)
        if j is None:
            continue
        desc, desc_weight = matched_desc(
            obj.desc,
            gt_objects[j].desc,
            weight=target.desc_ce_weight_matched,
            mask_correct=target.mask_correct_matched_desc,
            always_gt=False,
        )
        if desc != obj.desc:  # the span's weights are replaced by the splice's below
            splices.append(
                _desc_splice(obj, desc, desc_weight, prefix_bytes, starts, encode, vocab, neighbour_weights)
            )
        for k in range(*obj.desc_token_span):
            weights[k] = min(neighbour_weights[k], desc_weight)
        for position in obj.coord_positions:
            weights[position] = 0.0
        matched.append((obj, box_bins(gt_objects[j])))

    # apply the desc splices (disjoint, each inside its own entry); `new_position` maps the rest
    ids_out: list[int] = []
    weights_out: list[float] = []
    new_position: dict[int, int] = {}
    k = 0
    for splice in [*sorted(splices, key=lambda sp: sp.start), None]:
        stop = len(prefix) if splice is None else splice.start
        assert k <= stop, "desc splices overlap"
        for q in range(k, stop):
            new_position[q] = len(ids_out)
            ids_out.append(prefix[q])
            weights_out.append(weights[q])
        if splice is not None:
            ids_out += splice.ids
            weights_out += splice.weights
            k = splice.stop
    groups = [
        CoordGroup(
            (
                new_position[obj.coord_positions[0]],
                new_position[obj.coord_positions[1]],
                new_position[obj.coord_positions[2]],
                new_position[obj.coord_positions[3]],
            ),
            gt_bins,
        )
        for obj, gt_bins in matched
    ]

    fn_objects = sort_objects([gt_objects[j] for j in match.fn])
    fragment, desc_spans = append_fragment_with_desc_spans(
        fn_objects, max_object_index=parse.max_object_index, prefix_has_entries=parse.prefix_has_entries
    )
    tail = encode_checked(fragment, encode, vocab)
    tail_weights = desc_weighted(tail, vocab, desc_spans, [desc_ce_weight] * len(desc_spans))
    tail_groups = coord_groups(tail, len(ids_out), fn_objects, vocab)
    for group in tail_groups:
        for position in group.positions:
            tail_weights[position - len(ids_out)] = 0.0

    return Segment(
        channel="B",
        input_ids=[*ids_out, *tail, vocab.end_of_turn_id],
        ce_weights=[*weights_out, *tail_weights, 1.0],
        coord_groups=groups + tail_groups,
    )
