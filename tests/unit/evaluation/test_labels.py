"""Label metrics on hand-made pairs: the desc normalisation, desc accuracy on matched pairs, the
desc-aware precision / recall / F1 and the predicted-desc histogram (collapse detector)."""

from __future__ import annotations

import pytest

from stagectl.data.sample import DetObject
from stagectl.detection.matching import MatchResult
from stagectl.evaluation.labels import (
    TOP_DESCS,
    desc_histogram,
    label_metrics,
    matched_desc_count,
    normalize_desc,
)


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        ("red circle", "red circle", True),
        ("Red  Circle", "red circle", True),  # case and whitespace runs
        (" red\tcircle ", "red circle", True),
        ("ｒｅｄ circle", "red circle", True),  # NFKC: full-width letters
        ("red circles", "red circle", False),  # plurals are other descs
        ("red-circle", "red circle", False),  # so is punctuation
    ],
)
def test_normalize_desc(a: str, b: str, equal: bool) -> None:
    assert (normalize_desc(a) == normalize_desc(b)) is equal


def test_matched_desc_count_counts_only_matched_pairs_with_the_gt_desc() -> None:
    box = (0, 0, 10, 10)
    preds = [DetObject("Cat", box), DetObject("dog", box), DetObject("cat", box), DetObject("cat", box)]
    gt = [DetObject("cat", box), DetObject("cat", box), DetObject("dog", box)]
    # pred 0 ("Cat") -> gt 0 (cat): right; pred 1 (dog) -> gt 1 (cat): wrong; pred 3 (cat) -> gt 2 (dog): wrong
    # pred 2 says "cat" like gt 1 but is unmatched: it does not count
    match = MatchResult(pairs=[(0, 0), (1, 1), (3, 2)], fp=[2], fn=[], ious=[1.0, 1.0, 1.0])
    assert matched_desc_count(preds, gt, match) == 1
    assert matched_desc_count(preds, gt, MatchResult([], [0, 1, 2, 3], [0, 1, 2], [])) == 0


def test_label_metrics_are_the_box_f1_with_wrong_labels_as_misses() -> None:
    m = label_metrics(n_matched_desc=3, n_matched=4, n_pred=6, n_gt=5)
    assert m["desc_accuracy"] == pytest.approx(3 / 4)
    assert (m["precision_desc"], m["recall_desc"]) == pytest.approx((3 / 6, 3 / 5))
    assert m["f1_desc"] == pytest.approx(2 * 0.5 * 0.6 / 1.1)
    assert m["n_matched_desc"] == 3
    empty = label_metrics(0, 0, 0, 0)  # nothing predicted, nothing to find: zeros, no division error
    assert (empty["desc_accuracy"], empty["f1_desc"]) == (0.0, 0.0)


def test_desc_histogram_detects_a_collapse() -> None:
    gt = ["red circle", "blue square", "green star", "red circle"]
    collapsed = desc_histogram(["red circle"] * 7 + ["Red Circle", "blue square"], gt)
    assert collapsed["pred_desc_top"] == [["red circle", 8], ["blue square", 1]]
    assert collapsed["pred_desc_top_share"] == pytest.approx(8 / 9)
    assert (collapsed["num_pred_descs"], collapsed["num_gt_descs"]) == (2, 3)
    assert collapsed["gt_desc_top_share"] == pytest.approx(2 / 4)
    # ties are listed alphabetically, at most TOP_DESCS of them
    many = desc_histogram([f"d{k:02d}" for k in range(TOP_DESCS + 5)], gt)
    assert [d for d, _ in many["pred_desc_top"]] == [f"d{k:02d}" for k in range(TOP_DESCS)]
    assert many["pred_desc_top_share"] == pytest.approx(1 / (TOP_DESCS + 5))
    none = desc_histogram([], [])
    assert (none["pred_desc_top"], none["pred_desc_top_share"], none["gt_desc_top_share"]) == ([], 0.0, 0.0)
