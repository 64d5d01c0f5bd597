"""Matching predicted boxes to ground-truth boxes with an IoU gate: Hungarian (`hungarian_match`, the
default) and greedy by IoU (`greedy_iou_match`), both optionally restricted to `allowed` pairs (a desc gate).

Modelled on DETR's matcher: one cost matrix built vectorised, one `linear_sum_assignment` call,
index pairs out. The matrix is augmented so anything may stay unmatched:

                 gt 0..M-1          dummy pred-slots 0..N-1
    pred 0..N-1  1 - IoU (gated)    fp_cost on the diagonal, infeasible elsewhere
    dummy 0..M-1 fn_cost diagonal   0
                 (infeasible off it)

A pair with IoU below `iou_gate` is infeasible; a pair is matched only when that beats leaving
both unmatched (`1 - IoU < fp_cost + fn_cost`; a tie leaves them unmatched, see below).
Infeasible entries get a finite cost larger than any complete solution (`_INFEASIBLE`), so
the solver never picks them and never sees an infinite matrix.

Determinism: the same input gives the same output (SciPy's solver is deterministic). Ties between
exact duplicate boxes are settled explicitly: among identical predictions (or identical GT boxes)
the matches go to the lowest indices, so a repeated object keeps its first occurrence and the
repeats become FP. Other equal-cost ties keep the solver's (deterministic) choice. Boxes are (x1, y1, x2, y2) in any common unit (bins or pixels: IoU is
invariant to scaling an axis). A zero-area box has IoU 0 with everything except an identical box.

`allowed` [N, M] (bool, optional) forbids the pairs it marks False, exactly like an IoU below the gate: a
desc gate (`stage2_ab.channel_b.match.desc_gated`) passes `pred desc == GT desc`, so a prediction with the
wrong label is an FP and the GT object it overlaps a miss.

Greedy by IoU: among the feasible pairs (the same feasibility as Hungarian: allowed, IoU >= gate and
`1 - IoU < fp_cost + fn_cost`), repeatedly take the pair of highest IoU whose prediction and GT are both
still free (ties: lower prediction index, then lower GT index). It maximises no total; it is what COCO-style
evaluators do, and it never trades a pair's IoU for another's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

BoxesLike = Sequence[Sequence[float]] | np.ndarray


@dataclass(frozen=True)
class MatchResult:
    pairs: list[tuple[int, int]]  # (pred_index, gt_index), sorted by pred_index
    fp: list[int]  # unmatched pred indices, ascending
    fn: list[int]  # unmatched gt indices, ascending
    ious: list[float]  # IoU of each pair, same order as `pairs`


def _as_boxes(boxes: BoxesLike, name: str) -> np.ndarray:
    array = np.asarray(boxes, dtype=np.float64)
    if array.size == 0:
        return array.reshape(0, 4)
    if array.ndim != 2 or array.shape[1] != 4:
        raise ValueError(f"{name} must have shape (n, 4), got {array.shape}")
    return array


def pairwise_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in `a` [N, 4] with every box in `b` [M, 4] -> [N, M]."""
    area_a = (a[:, 2] - a[:, 0]).clip(min=0) * (a[:, 3] - a[:, 1]).clip(min=0)  # [N]
    area_b = (b[:, 2] - b[:, 0]).clip(min=0) * (b[:, 3] - b[:, 1]).clip(min=0)  # [M]
    inter_w = np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0])  # [N, M]
    inter_h = np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1])  # [N, M]
    inter = inter_w.clip(min=0) * inter_h.clip(min=0)  # [N, M]
    union = area_a[:, None] + area_b[None, :] - inter  # [N, M]
    empty = union <= 0  # both boxes have zero area
    iou = inter / np.where(empty, 1.0, union)
    if empty.any():
        rows, cols = np.nonzero(empty)
        iou[rows, cols] = (a[rows] == b[cols]).all(axis=1)  # identical degenerate boxes match perfectly
    return iou


def augmented_cost(iou: np.ndarray, *, iou_gate: float, fp_cost: float, fn_cost: float) -> np.ndarray:
    """The [N + M, M + N] cost matrix of the module docstring, from an IoU matrix [N, M]."""
    num_pred, num_gt = iou.shape
    infeasible = _infeasible_cost(num_pred, num_gt, fp_cost, fn_cost)
    cost = np.full((num_pred + num_gt, num_gt + num_pred), infeasible)
    cost[:num_pred, :num_gt] = np.where(iou >= iou_gate, 1.0 - iou, infeasible)  # pred x gt
    cost[np.arange(num_pred), num_gt + np.arange(num_pred)] = fp_cost  # pred -> its own dummy: FP
    cost[num_pred + np.arange(num_gt), np.arange(num_gt)] = fn_cost  # dummy -> gt: FN
    cost[num_pred:, num_gt:] = 0.0  # dummy x dummy
    return cost


def _infeasible_cost(num_pred: int, num_gt: int, fp_cost: float, fn_cost: float) -> float:
    # Larger than the cost of any assignment that uses only feasible entries (each row costs at most
    # max(1, fp_cost, fn_cost)), so one infeasible entry can never pay off.
    return (num_pred + num_gt + 1) * (1.0 + fp_cost + fn_cost)


def _checked_inputs(
    pred_boxes: BoxesLike,
    gt_boxes: BoxesLike,
    allowed: np.ndarray | None,
    iou_gate: float,
    fp_cost: float,
    fn_cost: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    if not 0.0 <= iou_gate <= 1.0:
        raise ValueError(f"iou_gate must be in [0, 1], got {iou_gate}")
    if fp_cost < 0 or fn_cost < 0:
        raise ValueError(f"fp_cost and fn_cost must be >= 0, got {fp_cost} and {fn_cost}")
    pred = _as_boxes(pred_boxes, "pred_boxes")  # [N, 4]
    gt = _as_boxes(gt_boxes, "gt_boxes")  # [M, 4]
    if allowed is None:
        return pred, gt, None
    mask = np.asarray(allowed, dtype=bool)
    if mask.shape != (len(pred), len(gt)):
        raise ValueError(f"allowed must have shape ({len(pred)}, {len(gt)}) (preds x GT), got {mask.shape}")
    return pred, gt, mask


def _result(pairs: list[tuple[int, int]], iou: np.ndarray, num_pred: int, num_gt: int) -> MatchResult:
    matched_pred = {i for i, _ in pairs}
    matched_gt = {j for _, j in pairs}
    return MatchResult(
        pairs=pairs,
        fp=[i for i in range(num_pred) if i not in matched_pred],
        fn=[j for j in range(num_gt) if j not in matched_gt],
        ious=[float(iou[i, j]) for i, j in pairs],
    )


def hungarian_match(
    pred_boxes: BoxesLike,
    gt_boxes: BoxesLike,
    *,
    iou_gate: float = 0.3,
    fp_cost: float = 1.0,
    fn_cost: float = 1.0,
    allowed: np.ndarray | None = None,
) -> MatchResult:
    """Match predictions to ground truth minimising sum(1 - IoU) + fp_cost * #FP + fn_cost * #FN, over the
    pairs `allowed` [N, M] permits (all when None)."""
    pred, gt, mask = _checked_inputs(pred_boxes, gt_boxes, allowed, iou_gate, fp_cost, fn_cost)
    num_pred, num_gt = len(pred), len(gt)
    if num_pred == 0 or num_gt == 0:
        return MatchResult(pairs=[], fp=list(range(num_pred)), fn=list(range(num_gt)), ious=[])

    iou = pairwise_iou(pred, gt)  # [N, M]
    gated = iou if mask is None else np.where(mask, iou, -1.0)  # a forbidden pair falls below any gate
    cost = augmented_cost(gated, iou_gate=iou_gate, fp_cost=fp_cost, fn_cost=fn_cost)  # [N + M, M + N]
    rows, cols = linear_sum_assignment(cost)  # rows sorted ascending
    is_pair = (rows < num_pred) & (cols < num_gt)
    # A real pair is only worth it when strictly cheaper than leaving both unmatched.
    is_pair &= cost[rows, cols] < fp_cost + fn_cost
    pairs = list(zip(rows[is_pair].tolist(), cols[is_pair].tolist(), strict=True))
    # identical boxes are interchangeable only when the gate treats them alike too (identical mask rows)
    pred_keys = pred if mask is None else np.concatenate([pred, mask], axis=1)  # [N, 4 (+ M)]
    gt_keys = gt if mask is None else np.concatenate([gt, mask.T], axis=1)  # [M, 4 (+ N)]
    pairs = _lowest_duplicates_first(_lowest_duplicates_first(pairs, pred_keys, side=0), gt_keys, side=1)
    return _result(pairs, iou, num_pred, num_gt)


def greedy_iou_match(
    pred_boxes: BoxesLike,
    gt_boxes: BoxesLike,
    *,
    iou_gate: float = 0.3,
    fp_cost: float = 1.0,
    fn_cost: float = 1.0,
    allowed: np.ndarray | None = None,
) -> MatchResult:
    """Match greedily by IoU (module docstring): the highest-IoU feasible pair first, then the next among
    the still-free predictions and GT objects."""
    pred, gt, mask = _checked_inputs(pred_boxes, gt_boxes, allowed, iou_gate, fp_cost, fn_cost)
    num_pred, num_gt = len(pred), len(gt)
    if num_pred == 0 or num_gt == 0:
        return MatchResult(pairs=[], fp=list(range(num_pred)), fn=list(range(num_gt)), ious=[])

    iou = pairwise_iou(pred, gt)  # [N, M]
    feasible = (iou >= iou_gate) & (1.0 - iou < fp_cost + fn_cost)  # [N, M], Hungarian's feasibility
    if mask is not None:
        feasible &= mask
    rows, cols = np.nonzero(feasible)  # row-major: ascending pred, then GT
    order = np.argsort(-iou[rows, cols], kind="stable")  # highest IoU first; ties keep (pred, GT) order
    free_pred, free_gt = np.ones(num_pred, dtype=bool), np.ones(num_gt, dtype=bool)
    pairs = []
    for i, j in zip(rows[order].tolist(), cols[order].tolist(), strict=True):
        if free_pred[i] and free_gt[j]:
            free_pred[i] = free_gt[j] = False
            pairs.append((i, j))
    return _result(sorted(pairs), iou, num_pred, num_gt)


def _lowest_duplicates_first(
    pairs: list[tuple[int, int]], boxes: np.ndarray, side: int
) -> list[tuple[int, int]]:
    """Among identical rows of `boxes` (a box, plus its row of the `allowed` mask when gated) on one side
    (0: preds, 1: GT), hand the matches to the lowest indices. Identical rows have identical cost rows
    (columns), so the total cost does not change."""
    rows = [tuple(box) for box in boxes.tolist()]
    if len(set(rows)) == len(rows):
        return pairs
    members_of_box: dict[tuple[float, ...], list[int]] = {}
    for index, box in enumerate(rows):
        members_of_box.setdefault(box, []).append(index)  # ascending indices
    partner = {pair[side]: pair[1 - side] for pair in pairs}
    out = []
    for members in members_of_box.values():
        partners = sorted(partner[m] for m in members if m in partner)
        out += [(m, p) if side == 0 else (p, m) for m, p in zip(members, partners, strict=False)]
    return sorted(out)
