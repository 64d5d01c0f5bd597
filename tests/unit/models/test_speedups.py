"""`training.kernels`' model paths against the eager ones on the tiny Qwen2.5-VL: varlen packed attention
(packed logits and gradients equal the sdpa block-diagonal mask; padded batches keep sdpa), torch.compile
per block (same logits and gradients; the full tier only: compiling takes ~15 s here), and liger's
selection (refused, naming why, without liger-kernel or CUDA: its triton kernels are GPU-only)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stagectl.collate import collate_pack, collate_padded
from stagectl.models import speedups, text_attention
from stagectl.models.loading import ModelBundle, load_bundle
from tests.helpers import image_segments


def _fresh() -> ModelBundle:
    torch.manual_seed(0)
    return load_bundle("builtin:tiny-qwen2.5-vl")


def _logits_and_grads(
    model: torch.nn.Module, inputs: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got: tuple[torch.Tensor, dict], want: tuple[torch.Tensor, dict]) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_varlen_packed_attention_equals_the_block_diagonal_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = _fresh()
    model = bundle.model
    segments = image_segments(bundle)
    pack = collate_pack(segments, model).model_inputs()
    padded = collate_padded(segments, bundle.tokenizer.pad_token_id).model_inputs()
    reference = _logits_and_grads(model, pack), _logits_and_grads(model, padded)
    applied = speedups.apply_speedups(
        model, torch.device("cpu"), liger=False, packed_attention="varlen", torch_compile=False
    )
    assert applied == ["varlen packed attention"]
    assert model.config.get_text_config()._attn_implementation == text_attention.TEXT_VARLEN
    pieces: list[int] = []  # segments per varlen call
    batches = text_attention.equal_length_batches

    def counted(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, *a: Any, **k: Any
    ) -> Any:
        pieces.append(len(cu) - 1)
        return batches(query, key, value, cu, *a, **k)

    monkeypatch.setattr(text_attention, "equal_length_batches", counted)
    lookups: list[int] = []  # segment lookups (each one syncs with the device)
    starts = text_attention.segment_starts
    monkeypatch.setattr(text_attention, "segment_starts", lambda *a: lookups.append(1) or starts(*a))
    _assert_same(_logits_and_grads(model, pack), reference[0])
    assert len(lookups) == 1  # once per forward, not once per layer
    num_layers = model.config.get_text_config().num_hidden_layers
    assert pieces == [len(segments)] * num_layers  # the pack went through the varlen path, per layer
    _assert_same(_logits_and_grads(model, padded), reference[1])  # a padded batch: transformers' sdpa
    assert len(pieces) == num_layers


@pytest.mark.parametrize(
    ("positions", "want"),
    [([0, 1, 2, 0, 1, 0], [0, 3, 5, 6]), ([0, 1, 2, 3], [0, 4]), ([5, 6, 7], None), (None, None)],
)
def test_segment_starts(positions: list[int] | None, want: list[int] | None) -> None:
    ids = None if positions is None else torch.tensor([positions])
    got = text_attention.segment_starts(ids, len(positions or [0, 0, 0]))
    assert (got.tolist() if got is not None else None) == want


def _varlen_2_10(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False):  # type: ignore[no-untyped-def]
    raise AssertionError("signature only")


def _varlen_window_no_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):  # type: ignore[no-untyped-def]
    raise AssertionError("signature only")


def _varlen_window_gqa(  # type: ignore[no-untyped-def]
    q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    raise AssertionError("signature only")


@pytest.mark.parametrize(
    ("varlen_attn", "want"),
    [
        (_varlen_2_10, {"is_causal": True}),
        (_varlen_window_no_gqa, {"window_size": (-1, 0)}),  # never a keyword the function lacks
        (_varlen_window_gqa, {"window_size": (-1, 0), "enable_gqa": True}),
    ],
)
def test_causal_gqa_kwargs_follow_the_installed_signature(
    varlen_attn: object, want: dict[str, object]
) -> None:
    assert text_attention._causal_gqa_kwargs(varlen_attn) == want


def test_varlen_needs_sdpa() -> None:
    bundle = load_bundle("builtin:tiny-qwen2.5-vl", attn_implementation="eager")
    with pytest.raises(
        ValueError, match=r"packed_attention: varlen needs the language model on sdpa.*'eager'"
    ):
        text_attention.use_varlen_text_attention(bundle.model)


def test_liger_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_bundle("builtin:tiny-qwen2.5-vl").model
    monkeypatch.setattr(speedups.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"needs liger-kernel \(pip install 'stagectl\[liger\]'"):
        speedups.apply_speedups(
            model, torch.device("cpu"), liger=True, packed_attention="mask", torch_compile=False
        )
    monkeypatch.setattr(speedups.importlib.util, "find_spec", lambda name: object())  # as if installed
    with pytest.raises(ValueError, match="run on CUDA only, the learner is on cpu"):
        speedups.apply_speedups(
            model, torch.device("cpu"), liger=True, packed_attention="mask", torch_compile=False
        )
    assert speedups.liger_problem(torch.device("cuda")) is None  # the kernel path is chosen on a GPU


def test_compile_blocks_compiles_every_block_in_place() -> None:
    model = load_bundle("builtin:tiny-qwen2.5-vl").model
    names = [n for n, _ in model.named_parameters()]
    blocks = speedups.transformer_blocks(model)
    count = speedups.compile_blocks(model, backend="aot_eager")  # lazy: nothing is traced until a forward
    text, vision = model.config.get_text_config(), model.config.vision_config
    assert count == len(blocks) == text.num_hidden_layers + vision.depth
    assert all(block._compiled_call_impl is not None for block in blocks)
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints and syncs see the same names


@pytest.mark.slow
def test_compiled_blocks_give_the_eager_logits_and_gradients() -> None:
    bundle = _fresh()
    model = bundle.model
    pack = collate_pack(image_segments(bundle), model).model_inputs()
    reference = _logits_and_grads(model, pack)
    speedups.compile_blocks(model, backend="aot_eager")  # traced graphs, no generated code: quick on CPU
    _assert_same(_logits_and_grads(model, pack), reference)
