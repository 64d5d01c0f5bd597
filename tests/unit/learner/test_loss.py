"""The learner loss: weighted CE, expectation decoding, SmoothL1 + CIoU, coordinate CE."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stagectl.config.plan_train import LossWeights
from stagectl.learner.loss import complete_iou, compute_loss, loss_rows

V = 1100
COORD_IDS = torch.arange(100, 1100)  # <|coord_k|> has id 100 + k


def peaked_logits(length: int, peaks: dict[int, int]) -> torch.Tensor:
    """Logits [L, V]; at position p the distribution is (almost) one-hot on token id peaks[p]."""
    logits = torch.zeros(length, V)
    for pos, token_id in peaks.items():
        logits[pos, token_id] = 50.0
    return logits


def test_weighted_ce_matches_manual() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    ids = torch.tensor([5, 7, 9, 11, 13, 15])
    w = torch.tensor([0.0, 1.0, 0.0, 0.5, 1.0, 1.0])
    terms = compute_loss(
        logits,
        ids,
        w,
        torch.zeros(0, 4, dtype=torch.long),
        torch.zeros(0, 4, dtype=torch.long),
        COORD_IDS,
        LossWeights(),
    )
    ce_all = F.cross_entropy(logits[:-1], ids[1:], reduction="none")
    expected = (ce_all * w[1:]).sum() / 4  # 4 tokens with weight > 0
    torch.testing.assert_close(terms.ce, expected)
    assert terms.num_ce_tokens == 4 and terms.num_boxes == 0
    assert float(terms.bbox_smoothl1) == 0.0 and float(terms.bbox_ciou) == 0.0


def test_geometry_zero_when_expected_box_equals_gt() -> None:
    gt = [100, 200, 600, 800]
    positions = torch.tensor([[2, 3, 4, 5]])
    # logits at position p-1 predict the slot at p
    logits = peaked_logits(7, {1: 100 + gt[0], 2: 100 + gt[1], 3: 100 + gt[2], 4: 100 + gt[3]})
    ids = torch.tensor([1, 2, *(100 + b for b in gt), 3])
    terms = compute_loss(
        logits, ids, torch.zeros(7), positions, torch.tensor([gt]), COORD_IDS, LossWeights(coord_ce=1.0)
    )
    assert float(terms.bbox_smoothl1) < 1e-6
    assert float(terms.bbox_ciou) < 1e-4
    assert float(terms.coord_ce) < 1e-4
    assert float(terms.coord_gate) < 1e-4
    assert terms.num_boxes == 1


def test_geometry_positive_and_differentiable_when_wrong() -> None:
    gt = torch.tensor([[100, 200, 600, 800]])
    logits = torch.zeros(7, V, requires_grad=True)
    positions = torch.tensor([[2, 3, 4, 5]])
    terms = compute_loss(
        logits, torch.zeros(7, dtype=torch.long), torch.zeros(7), positions, gt, COORD_IDS, LossWeights()
    )
    # uniform softmax -> expected bin 499.5 for every corner: a degenerate box far from GT
    assert float(terms.bbox_smoothl1.detach()) > 0.05 and float(terms.bbox_ciou.detach()) > 0.5
    terms.total.backward()
    assert logits.grad is not None
    coord_grad = logits.grad[1:5, 100:1100]
    assert torch.isfinite(coord_grad).all() and coord_grad.abs().sum() > 0
    assert float(terms.coord_ce) == 0.0  # off unless weighted


def test_ciou_stable_with_swapped_corners() -> None:
    pred = torch.tensor([[0.6, 0.8, 0.1, 0.2]], requires_grad=True)  # x2 < x1, y2 < y1
    gt = torch.tensor([[0.1, 0.2, 0.6, 0.8]])
    ciou = complete_iou(pred, gt)
    torch.testing.assert_close(ciou, torch.ones(1), atol=1e-5, rtol=0)
    ciou.sum().backward()
    assert pred.grad is not None and torch.isfinite(pred.grad).all()


def test_ciou_degenerate_boxes_finite() -> None:
    pred = torch.tensor([[0.5, 0.5, 0.5, 0.5]], requires_grad=True)
    gt = torch.tensor([[0.1, 0.1, 0.2, 0.2]])
    ciou = complete_iou(pred, gt)
    assert torch.isfinite(ciou).all() and float(ciou.detach()) < 0
    ciou.sum().backward()
    assert pred.grad is not None and torch.isfinite(pred.grad).all()


def test_ciou_penalises_distance_beyond_iou() -> None:
    gt = torch.tensor([[0.0, 0.0, 0.1, 0.1]])
    near = complete_iou(torch.tensor([[0.2, 0.0, 0.3, 0.1]]), gt)
    far = complete_iou(torch.tensor([[0.8, 0.0, 0.9, 0.1]]), gt)
    assert float(near) > float(far)  # both IoU 0, the farther one is worse


def test_weights_scale_terms() -> None:
    gt = torch.tensor([[100, 200, 600, 800]])
    logits = torch.zeros(7, V)
    positions = torch.tensor([[2, 3, 4, 5]])
    ids = torch.zeros(7, dtype=torch.long)
    ones = torch.ones(7)
    base = compute_loss(logits, ids, ones, positions, gt, COORD_IDS, LossWeights(1.0, 1.0, 0.0, 0.0))
    heavy = compute_loss(logits, ids, ones, positions, gt, COORD_IDS, LossWeights(2.0, 3.0, 1.0, 0.5))
    expected = base.ce + 2 * base.bbox_smoothl1 + 3 * base.bbox_ciou + heavy.coord_ce + 0.5 * heavy.coord_gate
    torch.testing.assert_close(heavy.total, expected)
    assert set(base.as_floats()) == {
        "loss",
        "loss/ce",
        "loss/bbox_smoothl1",
        "loss/bbox_ciou",
        "loss/coord_ce",
        "loss/coord_gate",
    }


def test_coord_gate_penalises_non_coordinate_tokens_in_slots() -> None:
    positions = torch.tensor([[2, 3, 4, 5]])
    gt = torch.tensor([[100, 200, 600, 800]])
    ids = torch.zeros(7, dtype=torch.long)
    on_coords = peaked_logits(7, {1: 150, 2: 250, 3: 650, 4: 850})  # coordinate tokens, wrong bins
    off_coords = peaked_logits(7, {1: 5, 2: 5, 3: 5, 4: 5})  # an ordinary token in every slot
    good = compute_loss(on_coords, ids, torch.zeros(7), positions, gt, COORD_IDS, LossWeights())
    bad = compute_loss(off_coords, ids, torch.zeros(7), positions, gt, COORD_IDS, LossWeights())
    assert float(good.coord_gate) < 1e-4  # it does not care which bin
    assert float(bad.coord_gate) > 10


def test_loss_on_supervised_rows_equals_loss_on_every_row() -> None:
    """The learner computes logits only at `loss_rows`; the terms and the gradient are those of the full
    logits (the rows the loss never reads get no gradient either way)."""
    torch.manual_seed(1)
    length = 12
    ids = torch.randint(0, V, (length,))
    w = torch.tensor([0.0, 0, 0, 0, 1, 0, 0, 0, 0, 0.5, 1, 0])  # CE off at the slots, as in Channel-B
    positions = torch.tensor([[5, 6, 7, 8]])
    gt = torch.tensor([[10, 200, 600, 990]])
    full = torch.randn(length, V, requires_grad=True)
    expected = compute_loss(full, ids, w, positions, gt, COORD_IDS, LossWeights(coord_ce=0.5))
    expected.total.backward()
    rows = loss_rows(w, positions)
    assert rows.tolist() == [3, 4, 5, 6, 7, 8, 9]  # t - 1 for each weighted t, and each slot
    kept = full.detach()[rows].clone().requires_grad_(True)
    got = compute_loss(kept, ids, w, positions, gt, COORD_IDS, LossWeights(coord_ce=0.5), rows=rows)
    got.total.backward()
    for name in ("total", "ce", "bbox_smoothl1", "bbox_ciou", "coord_ce", "coord_gate"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=0, atol=0)
    assert full.grad is not None and kept.grad is not None
    torch.testing.assert_close(kept.grad, full.grad[rows], rtol=0, atol=0)
    assert float(full.grad[[r for r in range(length) if r not in rows.tolist()]].abs().sum()) == 0.0


def _random_box_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    logits = torch.randn(11, V) * 3
    positions = torch.tensor([[2, 3, 4, 5], [6, 7, 8, 9]])
    gt = torch.tensor([[100, 200, 600, 800], [5, 5, 990, 990]])
    ids = torch.zeros(11, dtype=torch.long)
    return logits, ids, positions, gt


def test_smoothl1_beta_is_the_configured_one() -> None:
    logits, ids, positions, gt = _random_box_inputs(1)
    probs = logits[positions.reshape(-1) - 1][:, COORD_IDS].softmax(-1)
    expected_box = (probs * torch.arange(1000.0)).sum(-1).view(2, 4) / 999.0
    for beta in (0.05, 1.0):
        terms = compute_loss(
            logits, ids, torch.zeros(11), positions, gt, COORD_IDS, LossWeights(smoothl1_beta=beta)
        )
        torch.testing.assert_close(terms.bbox_smoothl1, F.smooth_l1_loss(expected_box, gt / 999.0, beta=beta))
    default = compute_loss(logits, ids, torch.zeros(11), positions, gt, COORD_IDS, LossWeights())
    torch.testing.assert_close(default.bbox_smoothl1, F.smooth_l1_loss(expected_box, gt / 999.0, beta=0.05))


def test_coord_ce_over_the_full_vocabulary_is_the_coordinate_ce_plus_the_gate() -> None:
    logits, ids, positions, gt = _random_box_inputs(2)
    full = compute_loss(logits, ids, torch.zeros(11), positions, gt, COORD_IDS, LossWeights(coord_ce=1.0))
    coord = compute_loss(
        logits,
        ids,
        torch.zeros(11),
        positions,
        gt,
        COORD_IDS,
        LossWeights(coord_ce=1.0, coord_ce_vocab="coord"),
    )
    slot_logits = logits[positions.reshape(-1) - 1]
    torch.testing.assert_close(coord.coord_ce, F.cross_entropy(slot_logits[:, COORD_IDS], gt.reshape(-1)))
    torch.testing.assert_close(full.coord_ce, F.cross_entropy(slot_logits, COORD_IDS[gt.reshape(-1)]))
    # -log p_full(gt) = -log p_coord(gt) - log P(any coordinate token): `full` already holds the gate
    torch.testing.assert_close(full.coord_ce, coord.coord_ce + coord.coord_gate)
    assert float(coord.coord_gate) > 0.05  # random logits: the gate term is not 0 (1000 of 1100 tokens)
