"""Packed logits (and gradients) equal per-segment logits for the tiny Qwen-VL models with images."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stagectl.collate import collate_pack, collate_padded
from stagectl.models.loading import load_bundle
from tests.helpers import image_segments, single_logits

pytestmark = pytest.mark.integration

ATOL = 1e-4


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
    segments = image_segments(bundle)
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
            single = single_logits(model, segment)
            torch.testing.assert_close(packed[start : start + len(segment)], single, atol=ATOL, rtol=0)

        # The test can fail: without the restarting text positions the segments attend to each other.
        broken = batch.model_inputs()
        broken["position_ids"] = batch.position_ids[1:]
        assert (model(**broken).logits[0] - packed).abs().max() > 100 * ATOL

        padded_batch = collate_padded(segments, pad_token_id=bundle.tokenizer.pad_token_id)
        padded = model(**padded_batch.model_inputs()).logits
        for row, segment in enumerate(segments):
            torch.testing.assert_close(
                padded[row, : len(segment)], single_logits(model, segment), atol=ATOL, rtol=0
            )


def test_packed_gradients_equal_summed_per_segment_gradients(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGECTL_CACHE_DIR", str(cache))
    bundle = load_bundle("builtin:tiny-qwen2.5-vl")
    model = bundle.model
    segments = image_segments(bundle)

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
        loss = weighted_ce(single_logits(model, s), torch.tensor(s.input_ids), torch.tensor(s.ce_weights))
        loss.backward()  # gradients accumulate over segments
    assert len(packed_grads) > 50  # vision tower and language model both get gradients
    for name, param in model.named_parameters():
        assert param.grad is not None
        torch.testing.assert_close(packed_grads[name], param.grad, atol=1e-4, rtol=1e-3, msg=name)
