"""`PackRunner`: the LM head runs on the supervised rows of a pack only, with the loss and the gradients
of the full-logits computation."""

from __future__ import annotations

from typing import Any

import torch

from stagectl.collate import collate_pack
from stagectl.config.plan_train import LossWeights
from stagectl.learner.packs import PackRunner, StepAccumulator, takes_logits_to_keep
from stagectl.models.loading import load_bundle
from tests.helpers import image_segments


class AllLogits(torch.nn.Module):
    """The same model behind a forward that cannot choose positions: the runner falls back to every row."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs)


def _step(ddp_model: torch.nn.Module, base: torch.nn.Module, bundle: Any, batch: Any) -> tuple[dict, dict]:
    base.zero_grad(set_to_none=True)
    runner = PackRunner(
        ddp_model=ddp_model,
        base_model=ddp_model,
        loss_weights=LossWeights(coord_ce=0.5),
        coord_token_ids=torch.tensor(bundle.coord_token_ids),
        packing_length=batch.input_ids.shape[1],
        device=torch.device("cpu"),
    )
    acc = StepAccumulator()
    runner.run_batch(batch, scale=1.0, sync=True, acc=acc)
    grads = {n: p.grad.clone() for n, p in base.named_parameters() if p.grad is not None}
    return acc.terms, grads


def test_runner_computes_logits_on_supervised_rows_with_the_full_loss_and_gradients() -> None:
    torch.manual_seed(0)
    bundle = load_bundle("builtin:tiny-qwen2.5-vl")
    model = bundle.model
    batch = collate_pack(image_segments(bundle), model)
    head_rows: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: head_rows.append(out.shape[1]))
    assert takes_logits_to_keep(model) and not takes_logits_to_keep(AllLogits(model))
    rows_terms, rows_grads = _step(model, model, bundle, batch)
    full_terms, full_grads = _step(AllLogits(model), model, bundle, batch)
    hook.remove()
    length = batch.input_ids.shape[1]
    supervised = int((batch.ce_weights[0, 1:] > 0).sum())
    assert head_rows[0] < length // 2 and head_rows[0] >= supervised  # only the rows the loss reads
    assert head_rows[1] == length
    assert rows_terms.keys() == full_terms.keys()
    for key, value in full_terms.items():
        assert abs(rows_terms[key] - value) <= 1e-5 * max(1.0, abs(value)), key
    assert rows_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(rows_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
