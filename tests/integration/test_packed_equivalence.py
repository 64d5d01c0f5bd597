"""Packed logits (and gradients) equal per-segment logits for the tiny Qwen-VL models with images."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from stagectl.collate import CoordGroup, Segment, collate_pack, collate_padded
from stagectl.models.chat import encode_answer_text, encode_prompt, encode_training
from stagectl.models.loading import ModelBundle, load_bundle

pytestmark = pytest.mark.integration

ATOL = 1e-4
ANSWERS = [
    '{"object_1": {"desc": "red circle", "bbox_2d": ["<|coord_1|>", "<|coord_2|>", "<|coord_300|>", "<|coord_400|>"]}}',
    "{}",
    '{"object_1": {"desc": "blue square", "bbox_2d": ["<|coord_10|>", "<|coord_20|>", "<|coord_30|>", '
    '"<|coord_40|>"]}, "object_2": {"desc": "green star", "bbox_2d": ["<|coord_5|>", "<|coord_6|>", '
    '"<|coord_700|>", "<|coord_800|>"]}}',
]
IMAGE_SIZES = [(112, 112), (168, 112), (84, 140)]  # different grids -> different vision token counts


def _segments(bundle: ModelBundle) -> list[Segment]:
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


def _single_logits(model: torch.nn.Module, segment: Segment) -> torch.Tensor:
    out = model(
        input_ids=torch.tensor([segment.input_ids]),
        mm_token_type_ids=torch.tensor([segment.mm_token_type_ids]),
        pixel_values=segment.pixel_values,
        image_grid_thw=segment.image_grid_thw,
        use_cache=False,
    )
    return out.logits[0]  # (T, V)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # On a shared 2-core machine, torch's 2 intra-op threads oversubscribe the CPU and run ~30x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stagectl-cache")


@pytest.mark.parametrize(
    ("arch", "attn"),
    [("qwen2.5-vl", "sdpa"), ("qwen2.5-vl", "eager"), ("qwen2-vl", "sdpa"), ("qwen3-vl", "sdpa")],
)
def test_packed_logits_equal_per_segment_logits(
    arch: str, attn: str, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGECTL_CACHE_DIR", str(cache))
    bundle = load_bundle(f"builtin:tiny-{arch}", attn_implementation=attn)
    model = bundle.model
    segments = _segments(bundle)
    batch = collate_pack(segments, model)
    total = sum(len(s) for s in segments)
    assert batch.input_ids.shape == (1, total)
    assert batch.position_ids is not None and batch.position_ids.shape == (4, 1, total)
    assert batch.position_ids[0, 0, batch.segment_starts].tolist() == [0, 0, 0]  # text positions restart
    assert batch.pixel_values is not None and batch.image_grid_thw is not None
    assert batch.image_grid_thw.shape == (3, 3)
    assert batch.coord_positions.shape == (3, 4)
    for row, target in zip(batch.coord_positions.tolist(), batch.coord_targets.tolist(), strict=True):
        assert [bundle.coord_token_ids.index(int(batch.input_ids[0, p])) for p in row] == target

    with torch.no_grad():
        packed = model(**batch.model_inputs()).logits[0]
        for segment, start in zip(segments, batch.segment_starts, strict=True):
            single = _single_logits(model, segment)
            torch.testing.assert_close(packed[start : start + len(segment)], single, atol=ATOL, rtol=0)

        # The test can fail: without the restarting text positions the segments attend to each other.
        broken = batch.model_inputs()
        broken["position_ids"] = batch.position_ids[1:]
        assert (model(**broken).logits[0] - packed).abs().max() > 100 * ATOL

        padded_batch = collate_padded(segments, pad_token_id=bundle.tokenizer.pad_token_id)
        padded = model(**padded_batch.model_inputs()).logits
        for row, segment in enumerate(segments):
            torch.testing.assert_close(
                padded[row, : len(segment)], _single_logits(model, segment), atol=ATOL, rtol=0
            )


def test_packed_gradients_equal_summed_per_segment_gradients(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGECTL_CACHE_DIR", str(cache))
    bundle = load_bundle("builtin:tiny-qwen2.5-vl")
    model = bundle.model
    segments = _segments(bundle)

    def weighted_ce(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # logits at t-1 predict ids[t], weighted by weights[t].
        losses = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
        return (losses * weights[1:]).sum()

    batch = collate_pack(segments, model)
    model.zero_grad()
    weighted_ce(model(**batch.model_inputs()).logits[0], batch.input_ids[0], batch.ce_weights[0]).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    for s in segments:
        loss = weighted_ce(_single_logits(model, s), torch.tensor(s.input_ids), torch.tensor(s.ce_weights))
        loss.backward()  # gradients accumulate over segments
    assert len(packed_grads) > 50  # vision tower and language model both get gradients
    for name, param in model.named_parameters():
        assert param.grad is not None
        torch.testing.assert_close(packed_grads[name], param.grad, atol=1e-4, rtol=1e-3, msg=name)
