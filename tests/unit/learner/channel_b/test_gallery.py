"""The Channel-B gallery record of a hand-made rollout: the verdict on each object (as the target form saw
it), the appended misses, and the target's CE / geometry spans read from the built segment; which steps are
recorded; the record on disk, in step mode and from an async B step's ready packs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, replace
from itertools import groupby
from pathlib import Path
from typing import Any, cast

from PIL import Image

from stagectl.config.plan import MatchCosts
from stagectl.data.sample import DetectionSample, DetObject
from stagectl.detection.stats import RolloutStats
from stagectl.learner.channel_b.gallery import (
    RECORDS,
    BGallery,
    BRecord,
    TargetToken,
    build_record,
    sampled_steps,
)
from stagectl.learner.channel_b.protocol import Decision
from stagectl.learner.channel_b.records import ReadyPack, Rollout
from stagectl.learner.segments import SampleEncoder
from stagectl.models.generate import Generation
from tests.unit.helpers import CHAR, ToyEncoder, target_plan
from tests.unit.helpers import answer_entry as entry

GT = [
    ("red square", (12, 11, 50, 52)),
    ("green star", (200, 300, 260, 380)),
    ("black box", (100, 100, 150, 120)),
]


# object_1 finds the green star, object_2 repeats it (IoU >= 0.7: a duplicate), object_3 is a false
# positive, object_4 is invalid (not a dict), and the rollout is cut inside object_5
ROLLOUT = (
    "{"
    + ", ".join(
        [
            entry(1, "green star", (201, 301, 259, 379)),
            entry(2, "green star", (201, 301, 259, 380)),
            entry(3, "blue ring", (600, 600, 700, 700)),
            '"object_4": 7',
        ]
    )
    + ', "object_5": {"desc": "re'
)


def record(target: str, image: str = "") -> BRecord:
    sample = DetectionSample([image], 1000, 1000, [DetObject(d, b) for d, b in GT])
    encoder = cast(SampleEncoder, ToyEncoder([sample]))
    return build_record(
        7,
        0,
        Generation(CHAR.encode(ROLLOUT), "length"),
        encoder,
        target_plan(target),
        MatchCosts(),
    )


def spans(rec: BRecord, kind: str) -> list[str]:
    """The target text of each maximal run of tokens of `kind` (geo / no loss)."""

    def of(t) -> str:  # type: ignore[no-untyped-def]
        return "geo" if t.geo else ("ce" if t.ce > 0 else "none")

    return ["".join(t.text for t in run) for key, run in groupby(rec.tokens, of) if key == kind]


def coords(*bins: int) -> list[str]:
    return [f"<|coord_{b}|>" for b in bins]


def test_clean_prefix_record_lists_each_verdict_the_misses_and_the_weighted_spans() -> None:
    rec = record("clean_prefix")
    assert [(o.key, o.verdict) for o in rec.objects] == [
        ("object_1", "matched"),
        ("object_2", "duplicate"),
        ("object_3", "false_positive"),
        ("object_4", "invalid:not_a_dict"),
        ("tail", "cut"),
    ]
    assert rec.objects[0].iou is not None and 0.9 < rec.objects[0].iou < 1.0
    assert rec.misses == [{"gt": 0, "desc": "red square"}, {"gt": 2, "desc": "black box"}]
    text = "".join(t.text for t in rec.tokens)
    assert "blue ring" not in text and "object_4" not in text  # dropped from a clean prefix
    # geometry: the kept prediction's box (pulled toward its GT), then each appended miss's GT box
    assert spans(rec, "geo") == [*coords(201, 301, 259, 379, 12, 11, 50, 52, 100, 100, 150, 120)]
    assert spans(rec, "none") == ["green star"]  # a right desc of a matched object carries no CE
    assert rec.tokens[-1].text == "<|im_end|>" and rec.tokens[-1].ce == 1.0


def test_raw_prefix_record_follows_the_judges_match() -> None:
    rec = record("raw_prefix")
    # Hungarian gives the GT to the closer repeat: object_2 matched, object_1 a false positive
    assert [(o.key, o.verdict) for o in rec.objects][:3] == [
        ("object_1", "false_positive"),
        ("object_2", "matched"),
        ("object_3", "false_positive"),
    ]
    none = spans(rec, "none")
    assert none[0].startswith('"object_1"') and "blue ring" in none[2] and '"object_4": 7' in none[2]
    assert spans(rec, "geo") == [*coords(201, 301, 259, 380, 12, 11, 50, 52, 100, 100, 150, 120)]


def test_a_rollout_with_an_id_past_the_byte_table_is_recorded() -> None:
    """A model whose embedding rows outnumber the tokenizer's vocabulary can sample an id with no bytes
    (the tiny FSDP / LoRA examples did, in train-ab's end-to-end runs): the record shows it, never raises."""
    past = len(CHAR.vocab.token_bytes) + 3
    sample = DetectionSample([""], 1000, 1000, [DetObject(d, b) for d, b in GT])
    rec = build_record(
        9,
        0,
        Generation([*CHAR.encode(ROLLOUT[:40]), past], "length"),
        cast(SampleEncoder, ToyEncoder([sample])),
        target_plan("clean_prefix"),
        MatchCosts(),
    )
    assert rec.rollout_text == ROLLOUT[:40] + f"<|id {past}|>"


def test_sampled_steps_spread_over_the_run() -> None:
    assert sampled_steps(20, 4) == [0, 5, 10, 15]
    assert sampled_steps(3, 8) == [0, 1, 2]
    assert sampled_steps(20, 0) == []


def test_the_gallery_records_the_first_b_step_at_each_sampled_point(tmp_path: Path) -> None:
    image = tmp_path / "img.png"
    Image.new("RGB", (100, 100), (255, 255, 255)).save(image)
    built: list[tuple[int, int]] = []

    def build(step: int, index: int, generation: Generation) -> BRecord:
        built.append((step, index))
        return record("clean_prefix", str(image))

    samples = [DetectionSample([str(image)], 1000, 1000, [DetObject(d, b) for d, b in GT])]
    gallery = BGallery(tmp_path / "b_gallery", samples, max_steps=20, num_records=2, build=build)
    gen = Generation(CHAR.encode(ROLLOUT), "length")
    for step in (3, 4, 11, 12):  # B steps; points 0 and 10 -> steps 3 and 11
        gallery.offer(step, [0], [gen])
        gallery.flush()
    assert built == [(3, 0), (11, 0)]
    lines = (tmp_path / "b_gallery" / RECORDS).read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert (tmp_path / "b_gallery" / first["image"]).is_file()
    assert [o["verdict"] for o in first["objects"]][:2] == ["matched", "duplicate"]
    assert gallery.flush() is None


def test_an_async_b_step_records_a_rollout_of_the_packs_it_trained_after_its_update(tmp_path: Path) -> None:
    """Async mode: `AsyncChannelB.run` keeps the first rollout record of the packs it trains (a sampled step
    only), `after_update` builds and writes its record through the step mode's `build_record` (the same
    verdicts and spans) and logs its cost; the steps before and after the sampled point record nothing."""
    from types import SimpleNamespace

    from stagectl.config.plan import AsyncQueue
    from stagectl.learner.channel_b.async_mode import AsyncChannelB
    from stagectl.learner.channel_b.clock import VersionClock

    image = tmp_path / "img.png"
    Image.new("RGB", (100, 100), (255, 255, 255)).save(image)
    sample = DetectionSample([str(image)], 1000, 1000, [DetObject(d, b) for d, b in GT])
    encoder = cast(SampleEncoder, ToyEncoder([sample, sample]))
    target = target_plan("clean_prefix")

    def build(step: int, index: int, generation: Generation) -> BRecord:
        return build_record(step, index, generation, encoder, target, MatchCosts())

    channel: Any = object.__new__(AsyncChannelB)  # only what run / after_update use is set
    channel.gallery = BGallery(
        tmp_path / "b_gallery", encoder.samples, max_steps=20, num_records=2, build=build
    )
    channel.runner = SimpleNamespace(run_batch=lambda batch, **kwargs: None)
    channel.clock = VersionClock()
    channel.queue_plan = AsyncQueue(sync_every_steps=100)  # no weight sync at these updates
    channel.gas, channel.rollouts_trained = 2, 0

    def b_step(step: int) -> dict[str, object]:
        other = Rollout(sample=0, stream_pos=2 * step + 1, token_ids=CHAR.encode("{}"), finish_reason="stop")
        first = Rollout(sample=1, stream_pos=2 * step, token_ids=CHAR.encode(ROLLOUT), finish_reason="length")
        empty = ReadyPack(batch=None, num_segments=0, stats=RolloutStats(), ver=0)  # type: ignore[arg-type]
        channel._held = [
            empty,
            ReadyPack(batch=None, num_segments=2, stats=RolloutStats(), ver=0, rollouts=[first, other]),  # type: ignore[arg-type]
        ]
        channel.run(step, Decision("B", 0), SimpleNamespace(samples=[]))  # type: ignore[arg-type]
        return channel.after_update(step + 1)

    # points 0 and 10: the first B step at or after each is recorded, once
    assert [sorted(b_step(step)) for step in (9, 10, 11)] == [["time/b_gallery_s"], ["time/b_gallery_s"], []]
    assert channel.gallery.last_write_s > 0
    lines = (tmp_path / "b_gallery" / RECORDS).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [9, 10]
    written = json.loads(lines[1])
    assert (written["step"], written["sample"]) == (10, 1)
    assert (tmp_path / "b_gallery" / written["image"]).is_file()
    assert [(o["key"], o["verdict"]) for o in written["objects"]] == [
        ("object_1", "matched"),
        ("object_2", "duplicate"),
        ("object_3", "false_positive"),
        ("object_4", "invalid:not_a_dict"),
        ("tail", "cut"),
    ]
    assert written["misses"] == [{"gt": 0, "desc": "red square"}, {"gt": 2, "desc": "black box"}]
    rec = cast(BRecord, SimpleNamespace(tokens=[TargetToken(**t) for t in written["tokens"]]))
    assert spans(rec, "geo") == [*coords(201, 301, 259, 379, 12, 11, 50, 52, 100, 100, 150, 120)]
    assert spans(rec, "none") == ["green star"]
    assert written["tokens"] == [asdict(t) for t in record("clean_prefix").tokens]  # as step mode builds it


def test_a_resumed_run_replaces_the_records_from_its_resume_step_and_records_each_point_once(
    tmp_path: Path,
) -> None:
    """A resume from step 12 kept the record of step 11 and appended a second one for step 11's point (and
    for step 12: the same PNG name, a different rollout): `records.jsonl` held two records of one step."""
    image = tmp_path / "img.png"
    Image.new("RGB", (100, 100), (255, 255, 255)).save(image)
    samples = [DetectionSample([str(image)], 1000, 1000, [DetObject(d, b) for d, b in GT])]
    out = tmp_path / "b_gallery"

    def build(step: int, index: int, generation: Generation) -> BRecord:
        return replace(record("clean_prefix", str(image)), step=step)

    def run(steps: Sequence[int], resume_step: int | None) -> None:
        gallery = BGallery(out, samples, max_steps=20, num_records=4, build=build, resume_step=resume_step)
        for step in steps:  # B steps
            gallery.offer(step, [0], [Generation(CHAR.encode(ROLLOUT), "length")])
            gallery.flush()

    def recorded() -> list[int]:
        return [json.loads(line)["step"] for line in (out / RECORDS).read_text().splitlines()]

    # points 0, 5, 10, 15; B steps 1, 6, 11, 12, 16
    run([1, 6, 11, 12, 16], None)
    assert recorded() == [1, 6, 11, 16]
    run([11, 12, 16], 11)  # resumed from checkpoint-11: step 11 is trained again
    assert recorded() == [1, 6, 11, 16]
    run([13, 16], 13)  # from checkpoint-13: 16 is dropped and recorded again; 11 covered point 10
    assert recorded() == [1, 6, 11, 16]
    assert sorted(p.name for p in out.glob("*.png")) == [
        f"step{s:06d}_sample00000.png" for s in (1, 6, 11, 16)
    ]
    (out / RECORDS).write_text((out / RECORDS).read_text() + '{"step": 17, "ima')  # a crash's torn line
    run([], 17)
    assert recorded() == [1, 6, 11, 16]


def test_a_record_names_the_policy_version_of_its_rollout(tmp_path: Path) -> None:
    """Step mode: the updates made before the step; async mode: the version of the pack the rollout came in
    (older than the learner's). A record said neither."""
    image = tmp_path / "img.png"
    Image.new("RGB", (100, 100), (255, 255, 255)).save(image)
    samples = [DetectionSample([str(image)], 1000, 1000, [DetObject(d, b) for d, b in GT])]

    def build(step: int, index: int, generation: Generation) -> BRecord:
        return replace(record("clean_prefix", str(image)), step=step)

    gallery = BGallery(tmp_path / "b", samples, max_steps=20, num_records=2, build=build)
    gallery.offer(3, [0], [Generation(CHAR.encode(ROLLOUT), "length")])  # step mode
    gallery.flush()
    rollout = Rollout(sample=0, stream_pos=0, token_ids=CHAR.encode(ROLLOUT), finish_reason="length")
    pack = ReadyPack(batch=None, num_segments=1, stats=RolloutStats(), ver=4, rollouts=[rollout])  # type: ignore[arg-type]
    gallery.offer_packs(12, [pack])  # async mode
    gallery.flush()
    lines = (tmp_path / "b" / RECORDS).read_text().splitlines()
    assert [(json.loads(line)["step"], json.loads(line)["gen_version"]) for line in lines] == [
        (3, 3),
        (12, 4),
    ]
