"""The Stage-2 AB loss on one packed micro-batch: weighted masked CE plus box geometry.

Geometry per box slot: the softmax over the 1000 coordinate logits gives the *expected* bin (not the
argmax, so it has a gradient); the 4 expectations / 999 form a box in [0, 1] that is compared to the GT
box with SmoothL1 and (1 - CIoU). Corners are sorted first, so a prediction with swapped corners still
gives a finite, well-defined CIoU. Every term is returned separately for logging.

The geometry softmax is restricted to the coordinate tokens, so it never teaches the model to emit a
coordinate token *at all* in a coordinate slot (CE is off there). The coordinate gate does:
-log P(any coordinate token) under the full softmax, mean over slots (`coord_gate_weight`; without it
a model learns the JSON around the boxes but fills them with ordinary tokens, which the parser drops).

Against upstream CoordExp (docs/training.md, "Loss parity"): SmoothL1's `beta` is `smoothl1_beta` (ours
0.05, upstream and torch 1.0), and coordinate CE runs over the full vocabulary (`coord_ce_vocab: full`,
which is the coordinate-only CE plus -log P(any coordinate token)) or, as upstream, over the 1000
coordinate logits alone (`coord`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stagectl.config.plan_train import LossWeights


@dataclass
class LossTerms:
    total: torch.Tensor  # scalar, differentiable
    ce: torch.Tensor
    bbox_smoothl1: torch.Tensor
    bbox_ciou: torch.Tensor
    coord_ce: torch.Tensor
    coord_gate: torch.Tensor
    num_ce_tokens: int
    num_boxes: int

    def as_floats(self) -> dict[str, float]:
        return {
            "loss": float(self.total.detach()),
            "loss/ce": float(self.ce.detach()),
            "loss/bbox_smoothl1": float(self.bbox_smoothl1.detach()),
            "loss/bbox_ciou": float(self.bbox_ciou.detach()),
            "loss/coord_ce": float(self.coord_ce.detach()),
            "loss/coord_gate": float(self.coord_gate.detach()),
        }


def loss_rows(ce_weights: torch.Tensor, coord_positions: torch.Tensor) -> torch.Tensor:
    """The sorted positions whose logits the loss reads: t - 1 for every CE-weighted token t and every
    coordinate slot. A detection pack supervises its answers only (the image and prompt tokens, most of
    the pack, have weight 0), so the LM head and the float32 logits need only these rows."""
    ce_rows = (ce_weights.reshape(-1)[1:] > 0).nonzero().flatten()
    return torch.unique(torch.cat([ce_rows, coord_positions.reshape(-1) - 1]))  # sorted


def compute_loss(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    ce_weights: torch.Tensor,
    coord_positions: torch.Tensor,
    coord_gt_bins: torch.Tensor,
    coord_token_ids: torch.Tensor,
    weights: LossWeights,
    rows: torch.Tensor | None = None,
) -> LossTerms:
    """logits [L, V] (one packed sequence), or [K, V] for the positions `rows` (`loss_rows`) alone;
    input_ids [L]; ce_weights [L] where ce_weights[t] scales the CE of predicting input_ids[t] from
    logits[t - 1] (ce_weights[0] is ignored); coord_positions [G, 4] token positions of the coordinate
    slots; coord_gt_bins [G, 4] in 0..999; coord_token_ids [1000]."""
    logits = logits.float()
    zero = logits.new_zeros(())

    def at(positions: torch.Tensor) -> torch.Tensor:  # logits of these sequence positions
        return logits[positions if rows is None else torch.searchsorted(rows, positions)]

    # --- weighted masked CE on next-token prediction: logits[t-1] predicts input_ids[t]
    w = ce_weights[1:].to(logits.dtype)  # [L-1]
    active = w > 0
    num_ce = int(active.sum())
    if num_ce:
        pred_logits = at(active.nonzero().flatten())  # [N, V]
        targets = input_ids[1:][active]  # [N]
        ce_tok = F.cross_entropy(pred_logits, targets, reduction="none")  # [N]
        ce = (ce_tok * w[active]).sum() / num_ce
    else:
        ce = zero
    # --- geometry on coordinate slots
    num_boxes = int(coord_positions.shape[0])
    if num_boxes:
        slot_logits = at(coord_positions.reshape(-1) - 1)  # [G*4, V]
        coord_logits = slot_logits[:, coord_token_ids]  # [G*4, 1000]
        probs = coord_logits.softmax(dim=-1)
        bins = torch.arange(coord_logits.shape[-1], device=logits.device, dtype=probs.dtype)
        expected = (probs * bins).sum(-1) / 999.0  # [G*4] in [0, 1]
        pred_boxes = expected.view(num_boxes, 4)
        gt_boxes = coord_gt_bins.to(probs.dtype) / 999.0  # [G, 4]
        smoothl1 = F.smooth_l1_loss(pred_boxes, gt_boxes, beta=weights.smoothl1_beta)
        ciou = (1.0 - complete_iou(pred_boxes, gt_boxes)).mean()
        if weights.coord_ce > 0 and weights.coord_ce_vocab == "full":
            coord_ce = F.cross_entropy(slot_logits, coord_token_ids[coord_gt_bins.reshape(-1)])
        elif weights.coord_ce > 0 and weights.coord_ce_vocab == "coord":
            coord_ce = F.cross_entropy(coord_logits, coord_gt_bins.reshape(-1))
        elif weights.coord_ce > 0:
            raise ValueError(f"coord_ce_vocab must be full or coord, got {weights.coord_ce_vocab!r}")
        else:
            coord_ce = zero
        # -log P(coordinate token) = logsumexp(all) - logsumexp(coordinate logits)
        coord_gate = (slot_logits.logsumexp(-1) - coord_logits.logsumexp(-1)).mean()
    else:
        smoothl1 = ciou = coord_ce = coord_gate = zero
    total = (
        ce
        + weights.bbox_smoothl1 * smoothl1
        + weights.bbox_ciou * ciou
        + weights.coord_ce * coord_ce
        + weights.coord_gate * coord_gate
    )
    return LossTerms(
        total=total,
        ce=ce,
        bbox_smoothl1=smoothl1,
        bbox_ciou=ciou,
        coord_ce=coord_ce,
        coord_gate=coord_gate,
        num_ce_tokens=num_ce,
        num_boxes=num_boxes,
    )


def complete_iou(pred: torch.Tensor, gt: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """CIoU of boxes [N, 4] (x1, y1, x2, y2); corners are sorted, so swapped corners are fine."""
    px1, px2 = torch.minimum(pred[:, 0], pred[:, 2]), torch.maximum(pred[:, 0], pred[:, 2])
    py1, py2 = torch.minimum(pred[:, 1], pred[:, 3]), torch.maximum(pred[:, 1], pred[:, 3])
    gx1, gx2 = torch.minimum(gt[:, 0], gt[:, 2]), torch.maximum(gt[:, 0], gt[:, 2])
    gy1, gy2 = torch.minimum(gt[:, 1], gt[:, 3]), torch.maximum(gt[:, 1], gt[:, 3])
    pw, ph = px2 - px1, py2 - py1
    gw, gh = gx2 - gx1, gy2 - gy1
    inter_w = (torch.minimum(px2, gx2) - torch.maximum(px1, gx1)).clamp(min=0)
    inter_h = (torch.minimum(py2, gy2) - torch.maximum(py1, gy1)).clamp(min=0)
    inter = inter_w * inter_h
    union = pw * ph + gw * gh - inter
    iou = inter / (union + eps)
    # distance between centres over the squared diagonal of the enclosing box
    cw = torch.maximum(px2, gx2) - torch.minimum(px1, gx1)
    ch = torch.maximum(py2, gy2) - torch.minimum(py1, gy1)
    c2 = cw**2 + ch**2 + eps
    rho2 = ((px1 + px2 - gx1 - gx2) ** 2 + (py1 + py2 - gy1 - gy2) ** 2) / 4
    # aspect-ratio consistency
    v = (4 / math.pi**2) * (torch.atan(gw / (gh + eps)) - torch.atan(pw / (ph + eps))) ** 2
    with torch.no_grad():
        alpha = v / (1 - iou + v + eps)
    return iou - rho2 / c2 - alpha * v
