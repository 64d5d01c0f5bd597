"""The Stage-2 AB loss with the LM head fused into it (`training.kernels.fused_linear_cross_entropy`).

`compute_loss` takes logits; here the model returns its final hidden states instead (the head runs on no
row inside the forward) and the loss applies the head itself: the weighted CE rows through
`stagectl.models.linear_ce` (in chunks, never the (rows, V) logits at once), the coordinate slots (4 per
box, a few dozen rows) through a plain matmul into `compute_loss`'s geometry terms, unchanged. The terms
equal `compute_loss` on `lm_head(hidden)`'s logits (tests/unit/learner/test_fused_loss.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from stagectl.config.plan_train import LossWeights
from stagectl.learner.loss import LossTerms, compute_loss
from stagectl.models.linear_ce import DEFAULT_CHUNK_ROWS, chunked_linear_cross_entropy


def compute_loss_from_hidden(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    input_ids: torch.Tensor,
    ce_weights: torch.Tensor,
    coord_positions: torch.Tensor,
    coord_gt_bins: torch.Tensor,
    coord_token_ids: torch.Tensor,
    weights: LossWeights,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> LossTerms:
    """hidden [L, H]: the final (normed) hidden states of one packed sequence (or a flattened padded batch);
    head_weight [V, H]: the LM head (no bias); the other arguments as `compute_loss`'s. Call it inside the
    forward's autocast region: the head's matmuls then run in the autocast dtype, as the eager head does."""
    w = ce_weights[1:].float()  # [L-1]: ce_weights[t] scales predicting input_ids[t] from row t - 1
    active = w > 0
    ce_rows = active.nonzero().flatten()
    num_ce = int(ce_rows.numel())
    if num_ce:
        ce_sum = chunked_linear_cross_entropy(
            hidden[ce_rows], head_weight, input_ids[1:][active], w[active], chunk_rows=chunk_rows
        )
        ce = ce_sum / num_ce
    else:
        ce = hidden.new_zeros((), dtype=torch.float32)
    # the geometry terms on the coordinate slots' logits alone (CE off: it is the fused term above)
    slot_rows = torch.unique(coord_positions.reshape(-1) - 1)  # sorted
    slot_logits = F.linear(hidden[slot_rows], head_weight)  # [K, V]
    with torch.autocast(hidden.device.type, enabled=False):  # as `compute_loss` runs after the eager forward
        geometry = compute_loss(
            slot_logits,
            input_ids,
            torch.zeros_like(ce_weights),
            coord_positions,
            coord_gt_bins,
            coord_token_ids,
            weights,
            rows=slot_rows,
        )
    return dataclasses.replace(geometry, total=geometry.total + ce, ce=ce, num_ce_tokens=num_ce)
