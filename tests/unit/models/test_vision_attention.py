"""The Qwen-VL vision towers' attention in one call per layer (`stagectl.models.vision_attention`) gives
transformers' per-window attention, forward and backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stagectl.collate import collate_pack
from stagectl.models import vision_attention
from stagectl.models.loading import load_bundle
from tests.helpers import image_segments


def _logits_and_grads(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(**batch.model_inputs()).logits
    logits.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "visual" in n and p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("name", ["builtin:tiny-qwen2.5-vl", "builtin:tiny-qwen3-vl"])
def test_batched_vision_attention_equals_the_per_window_loop(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    bundle = load_bundle(name)
    model, vision = bundle.model, bundle.model.config.vision_config
    assert vision._attn_implementation == vision_attention.VARLEN  # load_bundle switched it
    batch = collate_pack(image_segments(bundle), model)
    calls: list[tuple[int, ...]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(tuple(q.shape))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    got, got_grads = _logits_and_grads(model, batch)
    ours, calls[:] = len(calls), []
    vision._attn_implementation = "sdpa"  # transformers' own: one call per window / image
    want, want_grads = _logits_and_grads(model, batch)
    theirs = len(calls)
    monkeypatch.undo()
    # the language model's calls are in both counts; the vision tower's are batched by piece length
    num_lm_layers = model.config.get_text_config().num_hidden_layers
    assert num_lm_layers < ours <= theirs, (ours, theirs)
    if name == "builtin:tiny-qwen2.5-vl":  # equal-size windows: one call each for many
        assert ours < theirs, (ours, theirs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)


def test_other_models_and_explicit_implementations_are_left_alone() -> None:
    text = load_bundle("builtin:tiny-qwen2").model
    assert not vision_attention.use_varlen_vision_attention(text)
    eager = load_bundle("builtin:tiny-qwen2.5-vl", attn_implementation="eager").model
    assert eager.config.vision_config._attn_implementation == "eager"  # the reference stays the reference


def test_refuses_what_it_cannot_compute() -> None:
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        vision_attention.varlen_vision_attention(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=None)
