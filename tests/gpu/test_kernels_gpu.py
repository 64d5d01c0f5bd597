"""`training.kernels` and the hf engine's static KV cache on CUDA, against the eager paths (issue #45): varlen
packed attention through PyTorch's flash `varlen_attn`, the fused linear cross-entropy, liger's kernels (where
liger-kernel is installed), torch.compile per block with inductor, and the static cache's compiled decode."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from stagectl.collate import collate_pack
from stagectl.config.plan_train import LossWeights
from stagectl.learner.packs import PackRunner, StepAccumulator
from stagectl.learner.precision import Precision
from stagectl.models import speedups, text_attention
from stagectl.models.loading import ModelBundle, load_bundle
from tests.helpers import greedy_engine_ids, image_segments

BF16_ATOL = 0.05  # as tests/gpu/test_learner_gpu.py: bf16 logits of the tiny model are ~0.007 off float32
BF16 = Precision(torch.float32, torch.bfloat16, torch.float32, False)


def _fresh() -> ModelBundle:
    torch.manual_seed(0)
    return load_bundle("builtin:tiny-qwen2.5-vl", device="cuda")


def _bf16_logits_and_grads(
    model: Any, inputs: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(**inputs).logits.float()
    logits.logsumexp(-1).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close_bf16(
    got: tuple[torch.Tensor, dict], want: tuple[torch.Tensor, dict], grad_rel: float
) -> None:
    torch.testing.assert_close(got[0], want[0], atol=BF16_ATOL, rtol=0)
    for name, grad in want[1].items():
        error = (got[1][name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert error <= grad_rel, (name, float(error))


def test_varlen_packed_attention_runs_flash_varlen_and_equals_the_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bundle = _fresh()
    model = bundle.model
    inputs = collate_pack(image_segments(bundle), model).to("cuda").model_inputs()
    reference = _bf16_logits_and_grads(model, inputs)
    text_attention.use_varlen_text_attention(model)
    varlen = text_attention._torch_varlen()
    assert varlen is not None, "this torch has no torch.nn.attention.varlen"
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return varlen(*args, **kwargs)

    monkeypatch.setattr(text_attention, "_torch_varlen", lambda: counted)
    _assert_close_bf16(_bf16_logits_and_grads(model, inputs), reference, grad_rel=0.05)
    assert len(calls) == model.config.get_text_config().num_hidden_layers  # one flash call per layer


def test_fused_linear_cross_entropy_equals_the_eager_head_in_bf16() -> None:
    bundle = _fresh()
    model = bundle.model
    batch = collate_pack(image_segments(bundle), model)
    results = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        runner = PackRunner(
            ddp_model=model, base_model=model, loss_weights=LossWeights(coord_ce=0.5),
            coord_token_ids=torch.tensor(bundle.coord_token_ids, device="cuda"),
            packing_length=batch.input_ids.shape[1], device=torch.device("cuda"), precision=BF16,
            fused_linear_cross_entropy=fused,
        )  # fmt: skip
        acc = StepAccumulator()
        runner.run_batch(batch, scale=1.0, sync=True, acc=acc)
        results.append(
            (acc.terms, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (eager, eager_grads), (fused_terms, fused_grads) = results
    for key, value in eager.items():
        assert fused_terms[key] == pytest.approx(value, rel=2e-3, abs=2e-3), key
    for name, grad in eager_grads.items():
        assert (fused_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12) <= 0.05, name


def test_liger_kernels_equal_the_eager_model_in_bf16() -> None:
    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed (pip install 'stagectl[liger]', or scripts/gpu_wheels.sh)")
    bundle = _fresh()
    model = bundle.model
    inputs = collate_pack(image_segments(bundle), model).to("cuda").model_inputs()
    reference = _bf16_logits_and_grads(model, inputs)
    speedups.use_liger(model, torch.device("cuda"))
    _assert_close_bf16(_bf16_logits_and_grads(model, inputs), reference, grad_rel=0.05)


def test_compiled_blocks_equal_the_eager_model_with_inductor() -> None:
    bundle = _fresh()
    model = bundle.model
    inputs = collate_pack(image_segments(bundle), model).to("cuda").model_inputs()
    reference = _bf16_logits_and_grads(model, inputs)
    speedups.compile_blocks(model)  # inductor: generated triton kernels
    _assert_close_bf16(_bf16_logits_and_grads(model, inputs), reference, grad_rel=0.05)


def test_hf_engine_static_cache_greedy_ids_equal_the_dynamic_cache_on_cuda() -> None:
    """float32 on CUDA (so eager and compiled decoding agree on every argmax); the static cache's decode
    step is compiled by transformers on CUDA."""
    bundle = _fresh()
    dynamic, _, _ = greedy_engine_ids(bundle, "dynamic")
    static, batch_sizes, caches = greedy_engine_ids(bundle, "static")
    assert caches == {"StaticCache"} and static == dynamic and max(batch_sizes) > 1
