"""`chunked_linear_cross_entropy`: the weighted CE of `hidden @ weight.T` in row chunks equals the eager
linear + `F.cross_entropy`, loss and both gradients, in float32 and under CPU bf16 autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stagectl.models.linear_ce import chunked_linear_cross_entropy


def _inputs(n: int = 11, h: int = 16, v: int = 37) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    row_weights = torch.rand(n, generator=g) + 0.5
    return hidden, weight, targets, row_weights


def _eager(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return (F.cross_entropy(logits, targets, reduction="none") * w).sum()


@pytest.mark.parametrize("chunk_rows", [1, 4, 64])
@pytest.mark.parametrize("autocast", [False, True])
def test_chunked_equals_eager_loss_and_gradients(chunk_rows: int, autocast: bool) -> None:
    hidden, weight, targets, w = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        reference = _eager(hidden, weight, targets, w)
    reference.mul(1.7).backward()  # a non-unit upstream gradient
    ref_grads = hidden.grad.clone(), weight.grad.clone()  # type: ignore[union-attr]
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        fused = chunked_linear_cross_entropy(hidden, weight, targets, w, chunk_rows=chunk_rows)
    fused.mul(1.7).backward()
    # bf16: both round the logits to bf16 and the logits' gradient to bf16 before the matmuls
    tol = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(fused, reference, **tol)
    torch.testing.assert_close(hidden.grad, ref_grads[0], **tol)
    torch.testing.assert_close(weight.grad, ref_grads[1], **tol)
    assert weight.grad.dtype == weight.dtype and hidden.grad.dtype == hidden.dtype  # type: ignore[union-attr]


def test_frozen_weight_gets_no_gradient() -> None:
    hidden, weight, targets, w = _inputs()
    frozen = weight.detach()
    chunked_linear_cross_entropy(hidden, frozen, targets, w, chunk_rows=3).backward()
    reference = hidden.detach().requires_grad_()
    _eager(reference, frozen, targets, w).backward()
    torch.testing.assert_close(hidden.grad, reference.grad)
    assert frozen.grad is None


@pytest.mark.parametrize(
    ("hidden_shape", "target_len", "chunk_rows", "message"),
    [((5, 7), 5, 2, r"hidden \(5, 7\) and weight \(37, 16\)"), ((5, 16), 4, 2, r"targets \(4,\)"),
     ((5, 16), 5, 0, "chunk_rows must be >= 1")],
)  # fmt: skip
def test_bad_shapes_are_named(
    hidden_shape: tuple[int, int], target_len: int, chunk_rows: int, message: str
) -> None:
    _, weight, _, _ = _inputs()
    with pytest.raises(ValueError, match=message):
        chunked_linear_cross_entropy(
            torch.zeros(hidden_shape), weight, torch.zeros(target_len, dtype=torch.long), torch.ones(target_len),
            chunk_rows=chunk_rows,
        )  # fmt: skip
