"""Linear + cross-entropy in row chunks: the CE of `hidden @ weight.T` without materialising the logits.

The LM head over the loss rows of a 4,096-token pack of the 3B-sized model is (~1,800 x 152k) logits: the
bf16 matmul output, its float32 copy (~1.1 GB), the log-softmax and, in the backward, a float32 gradient of
the same size. Here the rows go through in chunks of `chunk_rows`: a chunk's logits are formed, turned into
its CE and, at once, into the CE's gradient with respect to those logits (w * (softmax - one-hot)), which is
multiplied back into the gradients of `hidden` and `weight`; only one chunk's logits ever exist, and the
backward only scales the gradients already computed (liger-kernel's fused linear cross-entropy, in plain
PyTorch matmuls and elementwise ops).

Why our own rather than a library: cut-cross-entropy (its `torch_compile` implementation included) imports
triton at module level on Linux, and liger-kernel is triton kernels, so neither imports on a CPU-only machine
(CPU torch ships no triton), where the equality tests run. The matmuls are the same FLOPs as the eager head;
the gain is memory and the elementwise passes over (rows, V) float32 tensors.

Precision follows the eager head under autocast: the matmuls run in `compute_dtype` (bf16 under
`mixed_precision: bf16`), the logits are promoted to float32 for the softmax, and the logits' gradient is cast
back to `compute_dtype` for the two backward matmuls, as autograd does for `lm_head(h).float()`.
"""

from __future__ import annotations

from typing import Any

import torch

DEFAULT_CHUNK_ROWS = 1024  # one chunk of a 152k vocab: 0.6 GB of float32 logits


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype an enclosing autocast region computes matmuls in on `device`; None outside autocast."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,  # (N, H)
        weight: torch.Tensor,  # (V, H)
        targets: torch.Tensor,  # (N,) long
        row_weights: torch.Tensor,  # (N,) float32
        chunk_rows: int,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        device_type = hidden.device.type
        with torch.autocast(device_type, enabled=False):
            w_c = weight.detach().to(compute_dtype)  # (V, H), cast once for every chunk
            want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_hidden = torch.zeros_like(hidden) if want_hidden else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk_rows):
                h_c = hidden[start : start + chunk_rows].detach().to(compute_dtype)  # (n, H)
                t = targets[start : start + chunk_rows]
                w = row_weights[start : start + chunk_rows]
                logits = (h_c @ w_c.T).float()  # (n, V)
                lse = logits.logsumexp(-1)  # (n,)
                total += ((lse - logits.gather(1, t[:, None]).squeeze(1)) * w).sum()
                if grad_hidden is None and grad_weight is None:
                    continue
                grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                grad[torch.arange(len(t), device=grad.device), t] -= 1.0
                grad_c = (grad * w[:, None]).to(compute_dtype)  # d(sum w CE) / d logits, (n, V)
                if grad_hidden is not None:
                    grad_hidden[start : start + chunk_rows] = (grad_c @ w_c).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += (grad_c.T @ h_c).float()
        ctx.save_for_backward(
            grad_hidden if grad_hidden is not None else torch.empty(0),
            grad_weight if grad_weight is not None else torch.empty(0),
        )
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        d_hidden = grad_hidden * grad_output.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        d_weight = (grad_weight * grad_output).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return d_hidden, d_weight, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    row_weights: torch.Tensor,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """sum_i row_weights[i] * CE(hidden[i] @ weight.T, targets[i]): hidden (N, H), weight (V, H) (an LM head
    without bias), targets (N,), row_weights (N,). `compute_dtype`: the matmuls' dtype (default: the enclosing
    autocast's, else `weight`'s). Differentiable in `hidden` and `weight`."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"chunked_linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
            "must be (N, H) and (V, H)"
        )
    if targets.shape != hidden.shape[:1] or row_weights.shape != hidden.shape[:1]:
        raise ValueError(
            f"chunked_linear_cross_entropy: targets {tuple(targets.shape)} and row_weights "
            f"{tuple(row_weights.shape)} must both be ({hidden.shape[0]},)"
        )
    if chunk_rows < 1:
        raise ValueError(f"chunked_linear_cross_entropy: chunk_rows must be >= 1, got {chunk_rows}")
    dtype = compute_dtype or autocast_dtype(hidden.device) or weight.dtype
    result: torch.Tensor = _ChunkedLinearCrossEntropy.apply(
        hidden, weight, targets, row_weights.float(), chunk_rows, dtype
    )
    return result
