"""Hungarian matching with an IoU gate: equal to brute force, to a direct solve, and edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from stagectl.detection.matching import (
    MatchResult,
    augmented_cost,
    greedy_iou_match,
    hungarian_match,
    pairwise_iou,
)


def random_boxes(rng: np.random.Generator, n: int, span: int) -> np.ndarray:
    corners = rng.integers(0, span, size=(n, 2, 2))
    return np.concatenate([corners.min(axis=1), corners.max(axis=1)], axis=1).astype(float)  # [n, 4]


def total_cost(result: MatchResult, fp_cost: float, fn_cost: float) -> float:
    return sum(1 - iou for iou in result.ious) + fp_cost * len(result.fp) + fn_cost * len(result.fn)


def brute_force_cost(iou: np.ndarray, gate: float, fp_cost: float, fn_cost: float) -> float:
    """Minimum over every partial one-to-one assignment (anything may stay unmatched)."""
    num_pred, num_gt = iou.shape
    best = math.inf

    def search(i: int, used: frozenset[int], cost: float) -> None:
        nonlocal best
        if i == num_pred:
            best = min(best, cost + fn_cost * (num_gt - len(used)))
            return
        search(i + 1, used, cost + fp_cost)
        for j in range(num_gt):
            if j not in used and iou[i, j] >= gate:
                search(i + 1, used | {j}, cost + 1 - iou[i, j])

    search(0, frozenset(), 0.0)
    return best


def check_structure(result: MatchResult, num_pred: int, num_gt: int, iou: np.ndarray, gate: float) -> None:
    preds = [i for i, _ in result.pairs]
    gts = [j for _, j in result.pairs]
    assert preds == sorted(preds) and len(set(gts)) == len(gts)
    assert sorted(preds + result.fp) == list(range(num_pred))
    assert sorted(gts + result.fn) == list(range(num_gt))
    for (i, j), value in zip(result.pairs, result.ious, strict=True):
        assert value == pytest.approx(iou[i, j]) and value >= gate


@pytest.mark.parametrize("seed", range(300))
def test_equals_brute_force_on_small_instances(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_pred, num_gt = rng.integers(0, 6, size=2)
    pred, gt = random_boxes(rng, num_pred, 12), random_boxes(rng, num_gt, 12)  # small span: overlaps, ties
    gate = float(rng.choice([0.0, 0.1, 0.3, 0.5, 0.9]))
    fp_cost, fn_cost = (float(c) for c in rng.choice([0.2, 0.5, 1.0, 2.0], size=2))
    result = hungarian_match(pred, gt, iou_gate=gate, fp_cost=fp_cost, fn_cost=fn_cost)
    iou = pairwise_iou(pred, gt) if num_pred and num_gt else np.zeros((num_pred, num_gt))
    check_structure(result, num_pred, num_gt, iou, gate)
    assert total_cost(result, fp_cost, fn_cost) == pytest.approx(
        brute_force_cost(iou, gate, fp_cost, fn_cost)
    )


@pytest.mark.parametrize("seed", range(20))
def test_equals_a_direct_solve_of_the_augmented_matrix(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    num_pred, num_gt = rng.integers(20, 80, size=2)
    pred = rng.uniform(0, 900, size=(num_pred, 2))
    pred = np.concatenate([pred, pred + rng.uniform(5, 120, size=(num_pred, 2))], axis=1)  # [N, 4]
    gt = pred[rng.choice(num_pred, size=min(num_gt, num_pred), replace=False)] + rng.normal(0, 8, size=(1, 4))
    gt = np.concatenate([gt, random_boxes(rng, num_gt - len(gt), 999)])  # [M, 4]
    result = hungarian_match(pred, gt, iou_gate=0.3, fp_cost=1.0, fn_cost=1.0)

    cost = augmented_cost(pairwise_iou(pred, gt), iou_gate=0.3, fp_cost=1.0, fn_cost=1.0)
    rows, cols = linear_sum_assignment(cost)
    direct = [(int(r), int(c)) for r, c in zip(rows, cols, strict=True) if r < num_pred and c < num_gt]
    assert result.pairs == direct
    assert total_cost(result, 1.0, 1.0) == pytest.approx(cost[rows, cols].sum())
    assert len(result.pairs) > 0


def test_empty_inputs() -> None:
    assert hungarian_match([], []) == MatchResult(pairs=[], fp=[], fn=[], ious=[])
    assert hungarian_match([[0, 0, 5, 5]], []) == MatchResult(pairs=[], fp=[0], fn=[], ious=[])
    assert hungarian_match(np.zeros((0, 4)), [[0, 0, 5, 5], [1, 1, 2, 2]]).fn == [0, 1]


def test_gate_makes_low_overlap_pairs_infeasible() -> None:
    pred, gt = [[0, 0, 10, 10]], [[5, 0, 15, 10]]  # IoU = 50 / 150 = 1/3
    assert hungarian_match(pred, gt, iou_gate=0.3).pairs == [(0, 0)]
    assert hungarian_match(pred, gt, iou_gate=0.3).ious == [pytest.approx(1 / 3)]
    gated = hungarian_match(pred, gt, iou_gate=0.34)
    assert (gated.pairs, gated.fp, gated.fn) == ([], [0], [0])


def test_a_pair_must_beat_leaving_both_unmatched() -> None:
    pred, gt = [[0, 0, 10, 10]], [[5, 0, 15, 10]]  # 1 - IoU = 2/3
    assert hungarian_match(pred, gt, iou_gate=0.0, fp_cost=0.3, fn_cost=0.3).pairs == []
    assert hungarian_match(pred, gt, iou_gate=0.0, fp_cost=0.4, fn_cost=0.3).pairs == [(0, 0)]


def test_ties_are_deterministic_and_prefer_the_lower_index() -> None:
    box = [10, 10, 20, 20]
    for _ in range(3):
        result = hungarian_match([box, box, box], [box])
        assert (result.pairs, result.fp, result.fn) == ([(0, 0)], [1, 2], [])
        result = hungarian_match([box], [box, box])
        assert (result.pairs, result.fp, result.fn) == ([(0, 0)], [], [1])


def test_iou_values_and_degenerate_boxes() -> None:
    a = np.array([[0, 0, 10, 10], [0, 0, 0, 10], [3, 3, 3, 3]], dtype=float)
    b = np.array([[0, 0, 10, 10], [5, 5, 15, 15], [3, 3, 3, 3]], dtype=float)
    iou = pairwise_iou(a, b)  # [3, 3]
    assert iou[0, 0] == 1.0 and iou[0, 1] == pytest.approx(25 / 175) and iou[0, 2] == 0.0
    assert iou[1].tolist() == [0.0, 0.0, 0.0]  # zero area
    assert iou[2, 2] == 1.0  # identical points count as a perfect match


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="shape"):
        hungarian_match([[0, 0, 1]], [[0, 0, 1, 1]])
    with pytest.raises(ValueError, match="iou_gate"):
        hungarian_match([], [], iou_gate=1.5)
    with pytest.raises(ValueError, match="fp_cost"):
        hungarian_match([], [], fp_cost=-1)


# ---------------------------------------------------------------- greedy by IoU and the `allowed` gate

CONFLICT_PRED = [[0, 0, 10, 10], [4, 0, 14, 10]]
CONFLICT_GT = [[1, 0, 11, 10], [-3, 0, 7, 10]]  # IoU [[0.82, 0.54], [0.54, 0.18]]


def test_greedy_takes_the_best_pair_where_hungarian_takes_the_best_total() -> None:
    hungarian = hungarian_match(CONFLICT_PRED, CONFLICT_GT, iou_gate=0.5)
    greedy = greedy_iou_match(CONFLICT_PRED, CONFLICT_GT, iou_gate=0.5)
    # Hungarian gives up pred 0's 0.82 so both predictions match (cost 0.92 against 0.18 + 1 + 1)
    assert (hungarian.pairs, hungarian.fp, hungarian.fn) == ([(0, 1), (1, 0)], [], [])
    # greedy keeps 0.82; pred 1's only feasible GT is then taken
    assert (greedy.pairs, greedy.fp, greedy.fn) == ([(0, 0)], [1], [1])
    assert greedy.ious == [pytest.approx(9 / 11)]


@pytest.mark.parametrize("seed", range(200))
def test_greedy_is_a_maximal_matching_taken_in_iou_order(seed: int) -> None:
    rng = np.random.default_rng(5000 + seed)
    num_pred, num_gt = rng.integers(0, 7, size=2)
    pred, gt = random_boxes(rng, num_pred, 12), random_boxes(rng, num_gt, 12)
    gate = float(rng.choice([0.0, 0.1, 0.3, 0.5]))
    result = greedy_iou_match(pred, gt, iou_gate=gate)
    iou = pairwise_iou(pred, gt) if num_pred and num_gt else np.zeros((num_pred, num_gt))
    check_structure(result, num_pred, num_gt, iou, gate)
    for i in result.fp:  # maximal: no feasible pair is left between two free objects
        assert all(iou[i, j] < gate for j in result.fn)
    matched_pred = {i for i, _ in result.pairs}
    matched_gt = {j for _, j in result.pairs}
    for (i, j), value in zip(result.pairs, result.ious, strict=True):
        # a feasible pair better than (i, j) sharing one of its ends: its other end was taken (earlier)
        for b in range(num_gt):
            if b != j and iou[i, b] >= gate and iou[i, b] > value:
                assert b in matched_gt
        for a in range(num_pred):
            if a != i and iou[a, j] >= gate and iou[a, j] > value:
                assert a in matched_pred


def test_allowed_forbids_pairs_in_both_assignments() -> None:
    allowed = np.array([[False, True], [True, True]])  # the pair greedy wanted is forbidden
    for match in (hungarian_match, greedy_iou_match):
        result = match(CONFLICT_PRED, CONFLICT_GT, iou_gate=0.5, allowed=allowed)
        assert (result.pairs, result.fp, result.fn) == ([(0, 1), (1, 0)], [], [])
        nothing = match(CONFLICT_PRED, CONFLICT_GT, iou_gate=0.0, allowed=np.zeros((2, 2), dtype=bool))
        assert (nothing.pairs, nothing.fp, nothing.fn) == ([], [0, 1], [0, 1])  # even at gate 0
    with pytest.raises(ValueError, match=r"allowed must have shape \(2, 2\)"):
        greedy_iou_match(CONFLICT_PRED, CONFLICT_GT, allowed=np.ones((2, 3), dtype=bool))


def test_identical_predictions_with_different_gates_are_not_swapped() -> None:
    # two identical boxes, only the second may match (its desc is right): the duplicate rule must not
    # hand the match to the lower index
    allowed = np.array([[False], [True]])
    result = hungarian_match([[0, 0, 10, 10], [0, 0, 10, 10]], [[0, 0, 10, 10]], allowed=allowed)
    assert (result.pairs, result.fp) == ([(1, 0)], [0])
