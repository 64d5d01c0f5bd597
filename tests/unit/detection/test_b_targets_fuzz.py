"""Property test: no model output kills a B step. An adversarial rollout (hostile descs, escapes, duplicate
keys, garbage entries, any truncation) becomes a Channel-B target in every shape `TargetPlan` offers, with
both toy tokenizers, and the target is well formed: coordinate groups on coordinate tokens, one weight per
token, the end-of-turn last, no CE inside a dropped or FP entry of a raw prefix."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagectl.config.plan import CleanPrefix, MatchCosts, RawPrefix, ReorderedGT, TargetPlan
from stagectl.data.sample import DetectionSample, DetObject
from stagectl.detection.judge import judge_rollout
from stagectl.learner.channel_b.packs import build_b_segments
from stagectl.learner.segments import SampleEncoder
from stagectl.models.generate import Generation
from tests.helpers import fuzz_examples
from tests.unit.helpers import CHAR, EOT, TOY_PROMPT, ToyEncoder, ToyTokenizer, random_objects, toy_tokenizer

if TYPE_CHECKING:
    from stagectl.models.chat import EncodedSample

FUSED = toy_tokenizer(['"]}}', '"]},', '"]}', "}}", "},", ' "', '{"', '":', '",', "object_", "desc", '": "'])
SETTINGS = settings(
    max_examples=fuzz_examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# desc literals as they appear between the quotes of the JSON text (escapes are the model's spelling)
HOSTILE_DESCS = (
    "red square",
    '\\"quoted\\"',
    "back\\\\slash",
    "\\u0022",
    "\\u003c|coord_5|\\u003e",  # decodes to <|coord_5|>
    "\\u003c|im_end|\\u003e",
    "<|coord_5|>",
    "red <|coord_999|> square",
    "<|im_end|>",
    "<|endoftext|>",
    "<|coord_5|",
    "<|coord_x",
    "   ",
    "\\t\\n",
    "",
    "ünïcødé 日本 🐱",
    "\\ud83d\\udc31",
    "\\ud83d",  # a lone surrogate: valid JSON, not encodable as UTF-8
    "\\udc31 tail",
    "\\u0000nul",
    "x" * 400,
    "object_1",
    '\\"}, \\"object_9\\": {\\"desc',
)
GARBAGE_ENTRIES = (
    '"object_{k}": {{"desc": "a", "bbox_2d": ["<|coord_1|>"]}}',
    '"object_{k}": {{"desc": "a", "desc": "b", "bbox_2d": ["<|coord_1|>", "<|coord_1|>", "<|coord_2|>", "<|coord_2|>"]}}',
    '"object_{k}": {{"desc": {{"x": 1}}, "bbox_2d": []}}',
    '"object_{k}": [1, 2, {{"a": "b"}}]',
    '"object_{k}": "<|coord_5|>"',
    '"object_{k}": {{"desc": "a", "bbox_2d": [1, 2, 3, 4]}}',
    '"object_{k}": {{"desc": "a", "bbox_2d": "<|coord_5|>"}}',
    '"object_{k}": {{"desc": "a", "poly": [], "bbox_2d": ["<|coord_1|>", "<|coord_1|>", "<|coord_2|>", "<|coord_2|>"]}}',
    '"obj_{k}": {{"desc": "a", "bbox_2d": ["<|coord_1|>", "<|coord_1|>", "<|coord_2|>", "<|coord_2|>"]}}',
    '"object_0{k}": 7',
    '"object_{k}": {{"desc": "a", "bbox_2d": ["<|coord_1|>", "<|coord_1|>", "<|coord_2|>", "<|coord_2|>"], "bbox_2d": []}}',
)
# a box as drawn, a point or line (x1 == x2), or a GT box (so the entry is matched and written again)
BOX_FORMS = ("as_is", "degenerate", "gt", "gt")
BINS = st.sampled_from([0, 0, 999, 999, 1, 500, 998]) | st.integers(min_value=0, max_value=999)
DESC = st.sampled_from(HOSTILE_DESCS) | st.text(max_size=12).map(lambda s: json.dumps(s)[1:-1])
ENTRY = st.one_of(
    st.tuples(st.just("ok"), DESC, st.tuples(BINS, BINS, BINS, BINS), st.sampled_from(BOX_FORMS)),
    st.tuples(st.just("garbage"), st.sampled_from(GARBAGE_ENTRIES), st.just((0, 0, 0, 0)), st.just("as_is")),
)


Entry = tuple[str, str, tuple[int, int, int, int], str]


def rollout_text(entries: list[Entry], keys: list[int], gt: list[DetObject]) -> str:
    parts = []
    for n, ((kind, text, (x1, y1, x2, y2), form), k) in enumerate(zip(entries, keys, strict=True)):
        if kind == "garbage":
            parts.append(text.format(k=k))
            continue
        if form == "degenerate":  # x1 == x2, and y1 == y2 (a point) or y2 < y1 (inverted)
            x2, y2 = x1, (y1 if y2 >= y1 else y2)
        elif form == "gt" and gt:
            x1, y1, x2, y2 = gt[n % len(gt)].bbox_2d
        box = ", ".join(f'"<|coord_{b}|>"' for b in (x1, y1, x2, y2))
        parts.append(f'"object_{k}": {{"desc": "{text}", "bbox_2d": [{box}]}}')
    return "{" + ", ".join(parts) + "}"


@dataclass
class TokEncoder(ToyEncoder):
    """`ToyEncoder` over any toy tokenizer."""

    tok: ToyTokenizer = CHAR

    def encode_text(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def prompt(self, index: int) -> EncodedSample:
        from stagectl.models.chat import EncodedSample  # imports torch
        from stagectl.models.images import ImageInputs

        ids = self.tok.encode(TOY_PROMPT)
        return EncodedSample(ids, [0] * len(ids), len(ids), ImageInputs(None, None, []))  # type: ignore[arg-type]


SHAPES = (
    RawPrefix(),
    CleanPrefix("clean_prefix", "tail_append"),
    CleanPrefix("clean_prefix", "sorted"),
    ReorderedGT(),
)
DESC_KNOBS = ((0.0, True), (0.5, True), (0.5, False), (1.0, False))
COSTS = (MatchCosts(), MatchCosts(assignment="greedy_iou"), MatchCosts(desc_gated=True))


def check_segment(
    tok: ToyTokenizer, plan: TargetPlan, costs: MatchCosts, ids: list[int], gt: list[DetObject]
) -> None:
    """Build the B segment of rollout `ids` as a B step does and check it."""
    sample = DetectionSample(images=[], width=1000, height=1000, objects=gt)
    encoder = cast(SampleEncoder, TokEncoder([sample], vocab=tok.vocab, tok=tok))
    kept, dropped = build_b_segments(
        [0], [Generation(ids, "stop")], encoder, plan, costs, packing_length=1_000_000
    )
    assert dropped.n_samples == 0 and len(kept) == 1
    segment = kept[0][1]
    vocab = tok.vocab
    n = len(tok.encode(TOY_PROMPT))
    assert len(segment.ce_weights) == len(segment.input_ids)
    assert segment.input_ids[-1] == vocab.end_of_turn_id
    assert all(w >= 0 for w in segment.ce_weights)
    grouped = [p for g in segment.coord_groups for p in g.positions]
    assert len(set(grouped)) == len(grouped) == 4 * len(segment.coord_groups)
    assert all(n <= p < len(segment.input_ids) for p in grouped)
    assert all(segment.input_ids[p] in vocab.coords.bin_of_id for p in grouped)
    assert all(segment.ce_weights[p] == 0.0 for p in grouped)
    assert all(0 <= b <= 999 for g in segment.coord_groups for b in g.gt_bins)
    assistant = segment.input_ids[n:]
    coord_slots = {k + n for k, t in enumerate(assistant) if t in vocab.coords.bin_of_id}
    if plan.kind != "raw_prefix":  # re-serialised: every coordinate token belongs to a box
        assert coord_slots == set(grouped)
        return
    parse, match, _, _ = judge_rollout(
        ids, gt, vocab, costs, duplicate_iou_threshold=plan.duplicate_iou_threshold
    )
    prefix = parse.prefix_token_ids
    # the prefix is copied up to the first matched desc written again (a splice shifts what follows)
    same = next((k for k, (a, b) in enumerate(zip(prefix, assistant, strict=False)) if a != b), len(prefix))
    fp = set(range(len(parse.valid_objects))) - {i for i, _ in match.pairs}
    spans = [parse.valid_objects[i].token_span for i in fp] + [d.token_span for d in parse.dropped_objects]
    for start, stop in spans:
        for k in range(start, min(stop, same)):
            assert segment.ce_weights[n + k] == 0.0, f"CE on a dropped/FP entry's token {k} ({plan.kind})"


@SETTINGS
@given(
    entries=st.lists(ENTRY, max_size=5),
    key_shuffle=st.integers(min_value=0, max_value=10**6),
    gt_seed=st.integers(min_value=0, max_value=10**6),
    cut=st.floats(min_value=0.0, max_value=1.0) | st.none(),
    end=st.sampled_from(["", EOT, EOT + "junk", "<|endoftext|>"]),
)
def test_any_rollout_gives_a_well_formed_b_target_in_every_shape(
    entries: list[Entry],
    key_shuffle: int,
    gt_seed: int,
    cut: float | None,
    end: str,
) -> None:
    rng = random.Random(key_shuffle)
    keys = [rng.choice([k + 1, k + 1, 1, 2, 10**9 + 7]) for k in range(len(entries))]  # duplicates too
    gt_rng = random.Random(gt_seed)
    gt = [DetObject(o.desc, o.bbox_2d) for o in random_objects(gt_rng)]
    if gt and gt_rng.random() < 0.3:
        gt[0] = DetObject('a "quoted" ünï \\ desc', (0, 0, 999, 999))
    text = rollout_text(entries, keys, gt) + end
    for tok in (CHAR, FUSED):
        ids = tok.encode(text)
        if cut is not None:
            ids = ids[: int(cut * len(ids))]
        for shape in SHAPES:
            for weight, mask in DESC_KNOBS:
                plan = TargetPlan(shape=shape, desc_ce_weight_matched=weight, mask_correct_matched_desc=mask)
                for costs in COSTS:
                    check_segment(tok, plan, costs, ids, gt)
