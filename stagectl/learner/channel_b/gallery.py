"""The Channel-B gallery: for a few sampled B steps (`stage2_ab.channel_b.gallery_steps`), one rollout as
the step trained it, written to `{output_dir}/b_gallery/` (`records.jsonl` + one PNG per record).

A record holds the rollout text, the judge's verdict on every object (matched with its IoU, false positive,
duplicate, invalid, cut), the ground-truth objects appended as misses, and the target tokens with the CE
weight each carried and whether it carried geometry loss. The spans are read from the built segment
(`collate.Segment.ce_weights` and `coord_groups`), whatever target form built it.

Cost: the step only keeps a reference to its first rollout (`offer`: step mode, the rollouts it just
generated; `offer_packs`: async mode, the first rollout record of the ready packs it trains); the record is
built and written after the optimizer update (`flush`, on sampled steps only), re-running the pure
parse/match/target build of that one rollout, by the same `build_record` in both modes. Sampled steps are the first B step at or after each of `gallery_steps` evenly spaced
points of `training.max_steps`. A record names the policy version whose weights generated its rollout
(`gen_version`, as `samples.jsonl` does: the updates made so far in step mode, the pack's weight-sync version
in async mode).

On resume, the records of steps at or after the resume step (and their PNGs) are dropped, as
`samples.jsonl`'s lines are, and the points an earlier record already covered are not recorded again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from stagectl.collate import Segment
from stagectl.config.plan import MatchCosts, TargetPlan
from stagectl.data.sample import DetectionSample
from stagectl.detection.judge import match_objects
from stagectl.detection.matching import MatchResult
from stagectl.detection.parse import RolloutParse
from stagectl.detection.vocab import TokenVocab
from stagectl.evaluation.gallery import DrawnBox, draw
from stagectl.learner.channel_b.records import ReadyPack
from stagectl.learner.segments import SampleEncoder
from stagectl.learner.setup import LearnerState
from stagectl.models.generate import Generation

B_GALLERY_DIR = "b_gallery"
RECORDS = "records.jsonl"


@dataclass(frozen=True)
class ObjectVerdict:
    key: str  # object_N as written (or "tail" for the unfinished one)
    desc: str
    verdict: str  # matched | false_positive | duplicate | invalid:<reason> | cut
    iou: float | None  # matched only
    bbox_2d: list[int] | None  # bins; None for invalid / cut entries


@dataclass(frozen=True)
class TargetToken:
    text: str
    ce: float  # CE weight the token carried
    geo: bool  # a coordinate token under geometry loss


@dataclass(frozen=True)
class BRecord:
    step: int
    sample: int
    target_kind: str
    rollout_text: str
    objects: list[ObjectVerdict]
    misses: list[dict[str, Any]]  # each GT object appended as a miss: {"gt": index, "desc": text}
    tokens: list[TargetToken]  # the assistant target (prompt left out)
    stop_reason: str = ""  # how the strict parse ended (`detection.parse`: closed, end of input, ...)
    gen_version: int | None = None  # the policy version that generated the rollout (None: not known)


def effective_match(
    parse: RolloutParse,
    match: MatchResult,
    duplicates: Sequence[int],
    gt: Sequence[Any],
    target: TargetPlan,
    costs: MatchCosts,
) -> tuple[dict[int, float], list[int]]:
    """({valid object index: IoU} of the matched predictions, the GT indices appended as misses) as the
    target form saw them: the judge's match for `raw_prefix`; for the forms that drop duplicates first
    (clean_prefix, reordered_gt) the match without them, as `packs.build_b_segment` builds it."""
    if target.kind == "raw_prefix":
        return {i: iou for (i, _), iou in zip(match.pairs, match.ious, strict=True)}, list(match.fn)
    dup = set(duplicates)
    kept = [i for i in range(len(parse.valid_objects)) if i not in dup]
    accepted = match_objects([parse.valid_objects[i] for i in kept], gt, costs)
    iou_of = {kept[i]: iou for (i, _), iou in zip(accepted.pairs, accepted.ious, strict=True)}
    return iou_of, list(accepted.fn)


def object_verdicts(
    parse: RolloutParse, iou_of: dict[int, float], duplicates: Sequence[int], vocab: TokenVocab
) -> list[ObjectVerdict]:
    """The verdict on every entry of the rollout: the valid ones in rollout order (matched with its IoU;
    else a duplicate or a false positive), then the invalid (dropped) entries, then the cut tail."""
    dup = set(duplicates)
    out = []
    for i, obj in enumerate(parse.valid_objects):
        if i in iou_of:
            verdict, iou = "matched", round(iou_of[i], 4)
        else:
            verdict, iou = ("duplicate" if i in dup else "false_positive"), None
        out.append(ObjectVerdict(f"object_{obj.key_index}", obj.desc, verdict, iou, list(obj.bbox_2d)))
    for dropped in parse.dropped_objects:
        text = _text(parse.prefix_token_ids[dropped.token_span[0] : dropped.token_span[1]], vocab)
        key = f"object_{dropped.key_index}" if dropped.key_index is not None else "?"
        out.append(ObjectVerdict(key, text.lstrip(", "), f"invalid:{dropped.reason}", None, None))
    if parse.truncated:
        out.append(ObjectVerdict("tail", "", "cut", None, None))
    return out


def target_tokens(segment: Segment, prompt_length: int, vocab: TokenVocab) -> list[TargetToken]:
    """The assistant part of `segment` (positions from `prompt_length`) with each token's CE weight and
    geometry flag, read from the segment itself."""
    geo = {p for group in segment.coord_groups for p in group.positions}
    return [
        TargetToken(_text([segment.input_ids[t]], vocab), float(segment.ce_weights[t]), t in geo)
        for t in range(prompt_length, len(segment))
    ]


def build_record(
    step: int,
    index: int,
    generation: Generation,
    encoder: SampleEncoder,
    target: TargetPlan,
    costs: MatchCosts,
) -> BRecord:
    """The record of sample `index`'s rollout at `step`: judged and built exactly as the B step built it
    (`packs.score_rollout`, `packs.build_b_segment`), with no length limit."""
    from stagectl.learner.channel_b.packs import build_b_segment, score_rollout

    parse, match, duplicates, _ = score_rollout(index, generation, encoder, target, costs)
    segment, _ = build_b_segment(index, generation, encoder, target, costs, packing_length=2**62)
    assert segment is not None  # no length limit
    gt = encoder.samples[index].objects
    iou_of, misses = effective_match(parse, match, duplicates, gt, target, costs)
    return BRecord(
        step=step,
        sample=index,
        target_kind=target.kind,
        rollout_text=_text(generation.token_ids, encoder.vocab),
        objects=object_verdicts(parse, iou_of, duplicates, encoder.vocab),
        misses=[{"gt": j, "desc": gt[j].desc} for j in misses],
        tokens=target_tokens(segment, len(encoder.prompt(index).input_ids), encoder.vocab),
        stop_reason=parse.stop_reason,
    )


def sampled_steps(max_steps: int, num_records: int) -> list[int]:
    """The steps from which on the next B step is recorded: `num_records` evenly spaced points."""
    if num_records <= 0:
        return []
    return sorted({(k * max_steps) // num_records for k in range(num_records)})


def _text(ids: Sequence[int], vocab: TokenVocab) -> str:
    """The bytes of `ids` as text; an id past the byte table (a model whose embedding rows outnumber the
    tokenizer's vocabulary samples one) is shown as `<|id N|>`, as the parser treats it: not text."""
    table = vocab.token_bytes
    return b"".join(table[t] if 0 <= t < len(table) else f"<|id {t}|>".encode() for t in ids).decode(
        "utf-8", errors="replace"
    )


class BGallery:
    """Keeps one rollout of each sampled B step and writes its record after the step (rank 0 only).

    `build` is a callable that builds the `BRecord` of (step, sample index, generation): the Channel-B
    code passes one over its own encoder and config, so this class holds no model state."""

    def __init__(
        self,
        out_dir: Path,
        samples: Sequence[DetectionSample],
        *,
        max_steps: int,
        num_records: int,
        build: Callable[[int, int, Generation], BRecord],
        resume_step: int | None = None,
    ) -> None:
        self.out_dir = out_dir
        self.samples = samples
        self.build = build
        self._due = sampled_steps(max_steps, num_records)
        if resume_step is not None:
            # the steps from `resume_step` on are trained again: their records go, and a point an earlier
            # record covered is not recorded again (an uninterrupted run popped it at that record)
            last = drop_records_from(out_dir, resume_step)
            self._due = [p for p in self._due if last is None or p > last]
        self._pending: tuple[int, int, Any, int | None] | None = None
        self.last_write_s = 0.0  # the last record's build + write time (logged as `time/b_gallery_s`)

    def wants(self, step: int) -> bool:
        return bool(self._due) and step >= self._due[0] and self._pending is None

    def offer(
        self, step: int, indices: Sequence[int], generations: Sequence[Any], gen_version: int | None = None
    ) -> None:
        """Called with a B step's rollouts (any chunk); keeps a reference to the first when the step is due.
        `gen_version`: the policy version that generated them (default: step mode's, the `step` updates made)."""
        if generations and self.wants(step):
            self._pending = (step, indices[0], generations[0], step if gen_version is None else gen_version)

    def offer_packs(self, step: int, packs: Sequence[ReadyPack]) -> None:
        """Async mode: called with the ready packs a B step trains; keeps the first rollout they carry
        (a `records.Rollout`, turned back into its `Generation`) when the step is due."""
        if not self.wants(step):
            return
        first = next(((r, pack.ver) for pack in packs for r in pack.rollouts), None)
        if first is not None:
            rollout, ver = first
            self.offer(step, [rollout.sample], [rollout.generation()], ver)

    def flush(self) -> Path | None:
        """Build and write the pending record (after the optimizer update); None when none is pending."""
        if self._pending is None:
            return None
        started = time.perf_counter()
        step, index, generation, gen_version = self._pending
        self._pending = None
        while self._due and self._due[0] <= step:
            self._due.pop(0)
        record = replace(self.build(step, index, generation), gen_version=gen_version)
        path = write_record(self.out_dir, record, self.samples[index])
        self.last_write_s = time.perf_counter() - started
        return path


def record_boxes(record: BRecord, sample: DetectionSample) -> list[DrawnBox]:
    """The record's objects to draw: GT (missed ones as appended misses) and the valid predictions."""
    from stagectl.data.sample import bins_to_pixel_box

    missed = {m["gt"] for m in record.misses}
    boxes = []
    for j, obj in enumerate(sample.objects):
        verdict = "missed" if j in missed else "matched"
        boxes.append(
            DrawnBox(
                bins_to_pixel_box(obj.bbox_2d, sample.width, sample.height), False, verdict, f"GT {obj.desc}"
            )
        )
    for o in record.objects:
        if o.bbox_2d is None:
            continue
        x1, y1, x2, y2 = o.bbox_2d
        label = o.desc + (f" IoU {o.iou:.2f}" if o.iou is not None else "")
        box_px = bins_to_pixel_box((x1, y1, x2, y2), sample.width, sample.height)
        boxes.append(DrawnBox(box_px, True, o.verdict, label))
    return boxes


def write_record(out_dir: Path, record: BRecord, sample: DetectionSample) -> Path:
    """The record's PNG and its line in `records.jsonl`; returns the PNG's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"step{record.step:06d}_sample{record.sample:05d}.png"
    draw(sample.images[0], sample.width, sample.height, record_boxes(record, sample)).save(out_dir / name)
    with open(out_dir / RECORDS, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"image": name, **asdict(record)}) + "\n")
    return out_dir / name


def drop_records_from(out_dir: Path, step: int) -> int | None:
    """Drop the records of steps >= `step` (and an unreadable line: a torn last line from a crash) from
    `out_dir/records.jsonl`, and their PNGs; rewritten through a temp file and a rename. Returns the step
    of the last record kept (None: none)."""
    path = out_dir / RECORDS
    if not path.is_file():
        return None
    kept, dropped, last = [], [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            row_step, image = int(row["step"]), str(row["image"])
        except (ValueError, KeyError, TypeError):
            continue
        if row_step < step:
            kept.append(line)
            last = row_step if last is None else max(last, row_step)
        else:
            dropped.append(image)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
    for image in dropped:
        (out_dir / Path(image).name).unlink(missing_ok=True)
    return last


def make_b_gallery(state: LearnerState) -> BGallery | None:
    """The run's Channel-B gallery (rank 0; step and async mode), None when `channel_b.gallery_steps` is 0."""
    cb = state.plan.channel_b
    if cb.gallery_steps == 0:
        return None
    encoder = state.encoder

    def build(step: int, index: int, generation: Generation) -> BRecord:
        return build_record(step, index, generation, encoder, cb.target, cb.match)

    return BGallery(
        state.plan.output_dir / B_GALLERY_DIR,
        encoder.samples,
        max_steps=state.plan.training.max_steps,
        num_records=cb.gallery_steps,
        build=build,
        resume_step=state.start_step if state.resumed_from is not None else None,
    )
