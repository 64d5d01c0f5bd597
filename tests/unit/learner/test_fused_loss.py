"""`training.kernels.fused_linear_cross_entropy`: the LM head applied inside the loss gives the eager
path's loss terms and gradients on the tiny Qwen2.5-VL's pack (float32 and CPU bf16 autocast), the
chunked CE included; the key is refused with fsdp."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stagectl.collate import collate_pack
from stagectl.config.plan_train import LossWeights
from stagectl.config.training import TrainingConfig
from stagectl.learner.fused_loss import compute_loss_from_hidden
from stagectl.learner.loss import compute_loss
from stagectl.learner.packs import PackRunner, StepAccumulator
from stagectl.learner.precision import Precision
from stagectl.models.loading import ModelBundle, load_bundle
from tests.helpers import image_segments

WEIGHTS = LossWeights(coord_ce=0.5)


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    torch.manual_seed(0)
    return load_bundle("builtin:tiny-qwen2.5-vl")


def _step(bundle: ModelBundle, batch: Any, fused: bool, compute: torch.dtype | None) -> tuple[dict, dict]:
    model = bundle.model
    model.zero_grad(set_to_none=True)
    runner = PackRunner(
        ddp_model=model, base_model=model, loss_weights=WEIGHTS,
        coord_token_ids=torch.tensor(bundle.coord_token_ids), packing_length=batch.input_ids.shape[1],
        device=torch.device("cpu"), precision=Precision(torch.float32, compute, torch.float32, False),
        fused_linear_cross_entropy=fused,
    )  # fmt: skip
    acc = StepAccumulator()
    runner.run_batch(batch, scale=1.0, sync=True, acc=acc)
    return acc.terms, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("compute", [None, torch.bfloat16], ids=["float32", "bf16"])
def test_fused_head_gives_the_eager_loss_terms_and_gradients(
    bundle: ModelBundle, compute: torch.dtype | None
) -> None:
    batch = collate_pack(image_segments(bundle), bundle.model)
    eager_terms, eager_grads = _step(bundle, batch, False, compute)
    fused_terms, fused_grads = _step(bundle, batch, True, compute)
    # float32: the same sums in another order. bf16: each path rounds its own partial sums to bf16 (the slot
    # rows' head gradient is a separate matmul here), measured at <= 1.7% of a parameter's gradient norm
    loss_rel, grad_rel = (1e-5, 1e-4) if compute is None else (2e-3, 0.04)
    assert fused_terms.keys() == eager_terms.keys()
    for key, value in eager_terms.items():
        assert fused_terms[key] == pytest.approx(value, rel=loss_rel, abs=loss_rel), key
    assert fused_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        error = (fused_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert error <= grad_rel, (name, float(error))


def test_chunked_head_equals_compute_loss_on_the_full_logits(bundle: ModelBundle) -> None:
    model = bundle.model
    batch = collate_pack(image_segments(bundle), model)
    with torch.no_grad():
        hidden = model(**batch.model_inputs(), output_hidden_states=True).hidden_states[-1][0]  # (L, H)
    hidden.requires_grad_(True)
    head = model.get_output_embeddings().weight
    ids, ce_w = batch.input_ids[0], batch.ce_weights[0]
    ids_args = (
        ids,
        ce_w,
        batch.coord_positions,
        batch.coord_targets,
        torch.tensor(bundle.coord_token_ids),
        WEIGHTS,
    )
    eager = compute_loss(hidden @ head.T, *ids_args)
    (eager_grad,) = torch.autograd.grad(eager.total, hidden)
    fused = compute_loss_from_hidden(hidden, head, *ids_args, chunk_rows=5)  # many chunks
    (fused_grad,) = torch.autograd.grad(fused.total, hidden)
    assert fused.num_ce_tokens == eager.num_ce_tokens > 5 and fused.num_boxes == eager.num_boxes > 0
    for key, value in eager.as_floats().items():
        assert fused.as_floats()[key] == pytest.approx(value, rel=1e-5), key
    torch.testing.assert_close(fused_grad, eager_grad, rtol=1e-4, atol=1e-7)


def test_fused_head_is_refused_with_fsdp() -> None:
    with pytest.raises(ValueError, match=r"fused_linear_cross_entropy .* parallelism: ddp"):
        TrainingConfig(parallelism="fsdp", kernels={"fused_linear_cross_entropy": True})  # type: ignore[arg-type]
