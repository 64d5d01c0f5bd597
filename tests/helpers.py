"""Builders shared by test tiers (never import one test module from another): the three image segments
of different grids that the packed-vs-unpacked checks pack, one segment's logits on its own, and the
example count of the property tests, and greedy ids through the `hf` engine."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image, ImageDraw

from stagectl.collate import CoordGroup, Segment
from stagectl.models.chat import encode_answer_text, encode_prompt, encode_training
from stagectl.models.loading import ModelBundle
from stagectl.models.sampling import SamplingSpec
from stagectl.rollout.engine import EngineRequest

ANSWERS = [
    '{"object_1": {"desc": "red circle", "bbox_2d": ["<|coord_1|>", "<|coord_2|>", "<|coord_300|>", "<|coord_400|>"]}}',
    "{}",
    '{"object_1": {"desc": "blue square", "bbox_2d": ["<|coord_10|>", "<|coord_20|>", "<|coord_30|>", '
    '"<|coord_40|>"]}, "object_2": {"desc": "green star", "bbox_2d": ["<|coord_5|>", "<|coord_6|>", '
    '"<|coord_700|>", "<|coord_800|>"]}}',
]
IMAGE_SIZES = [(112, 112), (168, 112), (84, 140)]  # different grids -> different vision token counts

FUZZ_PROFILES = ("ci", "full")


def fuzz_examples(full: int) -> int:
    """Examples per property test. `STAGECTL_FUZZ_PROFILE=full` runs `full` (the property's own count);
    the default `ci` profile (`make test`, `make test-fast`) runs a tenth of it, at least 20, so the inner
    loop stays fast while every run still draws fresh examples. `STAGECTL_FUZZ_EXAMPLES=N` (the long
    fuzzing pass, e.g. 5000) sets N for every property whatever the profile."""
    if os.environ.get("STAGECTL_FUZZ_EXAMPLES"):
        return int(os.environ["STAGECTL_FUZZ_EXAMPLES"])
    profile = os.environ.get("STAGECTL_FUZZ_PROFILE", "ci")
    if profile not in FUZZ_PROFILES:
        raise ValueError(f"STAGECTL_FUZZ_PROFILE={profile!r}: expected one of {', '.join(FUZZ_PROFILES)}")
    return full if profile == "full" else max(20, full // 10)


def image_segments(bundle: ModelBundle) -> list[Segment]:
    """Three Channel-A segments, one image each, of three different lengths."""
    segments = []
    coord_ids = set(bundle.coord_token_ids)
    for k, (size, answer) in enumerate(zip(IMAGE_SIZES, ANSWERS, strict=True)):
        image = Image.new("RGB", size, (40 * k, 120, 200))
        ImageDraw.Draw(image).ellipse((10, 10, 50 + 10 * k, 60), fill=(255, 0, 0))
        prompt = encode_prompt(bundle.tokenizer, bundle.image_processor, [image])
        sample = encode_training(prompt, encode_answer_text(bundle.tokenizer, answer), bundle.end_of_turn_id)
        n, start = len(sample.input_ids), sample.assistant_start
        coord_positions = [t for t in range(start, n) if sample.input_ids[t] in coord_ids]
        groups = [
            CoordGroup(
                tuple(coord_positions[i : i + 4]),  # type: ignore[arg-type]
                tuple(bundle.coord_token_ids.index(sample.input_ids[t]) for t in coord_positions[i : i + 4]),  # type: ignore[arg-type]
            )
            for i in range(0, len(coord_positions), 4)
        ]
        segments.append(
            Segment(
                input_ids=sample.input_ids,
                ce_weights=[0.0] * start + [1.0] * (n - start),
                mm_token_type_ids=sample.mm_token_type_ids,
                pixel_values=sample.pixel_values,
                image_grid_thw=sample.image_grid_thw,
                coord_groups=groups,
            )
        )
    assert len({len(s) for s in segments}) == 3
    return segments


def single_logits(model: torch.nn.Module, segment: Segment, device: str = "cpu") -> torch.Tensor:
    """`segment`'s logits (T, V) from a forward of that segment alone (no packing, no padding)."""
    pixels, grid = segment.pixel_values, segment.image_grid_thw
    out = model(
        input_ids=torch.tensor([segment.input_ids], device=device),
        mm_token_type_ids=torch.tensor([segment.mm_token_type_ids], device=device),
        pixel_values=None if pixels is None else pixels.to(device),
        image_grid_thw=None if grid is None else grid.to(device),
        use_cache=False,
    )
    return out.logits[0]


def _engine_requests() -> list[EngineRequest]:
    rng = np.random.default_rng(0)
    spec = SamplingSpec(max_new_tokens=12, temperature=0.0)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find every object."}]}
    ]
    sizes = ((56, 56), (84, 112), (56, 84))  # different image-token counts: a left-padded batch
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    return [EngineRequest(messages, [image], spec, seed=None) for image in images]


def greedy_engine_ids(bundle: ModelBundle, kv_cache: str) -> tuple[list[list[int]], dict[int, int], set[str]]:
    """Greedy ids of three concurrent image requests through an `hf` engine with `kv_cache`, the engine's
    batch sizes, and the KV cache classes the model decoded with."""
    from stagectl.rollout.server.engines.hf import HFEngine

    engine = HFEngine(bundle, model_name="tiny", max_batch_size=8, batch_wait_ms=200, kv_cache=kv_cache)  # type: ignore[arg-type]
    caches: set[str] = set()  # the cache class each forward decoded with

    def record(_module: object, _args: object, kwargs: dict) -> None:
        caches.add(type(kwargs.get("past_key_values")).__name__)

    hook = bundle.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with ThreadPoolExecutor(3) as pool:  # concurrent callers, one request each
            results = list(pool.map(lambda r: engine.generate([r])[0], _engine_requests()))
        return [r.token_ids for r in results], engine.batch_sizes(), caches
    finally:
        hook.remove()
        engine.close()
