"""Bootstrap intervals of held-out metrics (`stagectl.report.intervals`) on hand-made per-image counts."""

from __future__ import annotations

import numpy as np
import pytest

from stagectl.report.intervals import FIELDS, counts_from_row, difference_intervals, variant_intervals


def images(num: int, hit_rate: float, seed: int, dup_every: int = 0) -> np.ndarray:
    """`num` images with 2 GT each and 2 predictions, each a hit with probability `hit_rate`."""
    rng = np.random.default_rng(seed)
    matched = rng.binomial(2, hit_rate, size=num)
    dup = np.zeros(num) if not dup_every else (np.arange(num) % dup_every == 0).astype(float)
    right = rng.binomial(matched, 0.5)  # half the box hits carry the right desc
    cols = {
        "n_gt": 2,
        "n_valid": 2,
        "n_matched": matched,
        "n_invalid": 0,
        "n_truncated": 0,
        "n_dup": dup,
        "n_matched_desc": right,
    }
    return np.stack([np.broadcast_to(np.asarray(cols[f], dtype=float), (num,)) for f in FIELDS], axis=1)


def test_observed_values_are_the_micro_metrics_averaged_over_seeds() -> None:
    a, b = images(50, 0.8, 0, dup_every=5), images(50, 0.6, 1)
    iv = variant_intervals([a, b])
    f1_a = a[:, 2].sum() / a[:, 1].sum()  # precision == recall here, so F1 is the hit rate
    f1_b = b[:, 2].sum() / b[:, 1].sum()
    assert iv["f1"].value == pytest.approx((f1_a + f1_b) / 2)
    assert iv["dup_rate"].value == pytest.approx((10 / 100 + 0) / 2)
    assert iv["invalid_rate"].value == 0 and iv["invalid_rate"].half_width == 0
    assert iv["f1"].low <= iv["f1"].value <= iv["f1"].high


def test_interval_shrinks_with_more_images_and_matches_the_binomial_width() -> None:
    small = variant_intervals([images(100, 0.8, 0)])["f1"].half_width
    large = variant_intervals([images(1600, 0.8, 0)])["f1"].half_width
    assert large < small / 3  # ~ 1/sqrt(n)
    expected = 1.96 * np.sqrt(0.8 * 0.2 / (2 * 1600))  # binomial proportion over 3200 objects
    assert large == pytest.approx(expected, rel=0.25)


def test_difference_detects_a_real_gap_and_not_a_null_one() -> None:
    better = [images(400, 0.9, s) for s in range(3)]
    worse = [images(400, 0.7, 10 + s) for s in range(3)]
    gap = difference_intervals(better, worse)["f1"]
    assert gap.low > 0.1 and gap.value == pytest.approx(0.2, abs=0.05)
    same = difference_intervals(worse, worse)["f1"]
    assert same.value == 0 and same.low <= 0 <= same.high


def test_counts_from_row_reorders_fields_and_refuses_old_rows() -> None:
    row = {"per_image_fields": list(reversed(FIELDS)), "per_image": [[5, 0, 0, 0, 1, 2, 3]]}
    assert counts_from_row(row).tolist() == [[3, 2, 1, 0, 0, 0, 5]]
    with pytest.raises(ValueError, match="per_image"):
        counts_from_row({"f1": 0.5})
    with pytest.raises(ValueError, match="different numbers of images"):
        variant_intervals([images(3, 0.5, 0), images(4, 0.5, 0)])


def test_desc_metrics_are_the_evaluators_and_old_rows_leave_them_nan() -> None:
    from stagectl.evaluation.labels import label_metrics

    counts = [images(60, 0.8, s) for s in range(2)]
    iv = variant_intervals(counts)
    expected = [
        label_metrics(
            *(int(c[:, FIELDS.index(f)].sum()) for f in ("n_matched_desc", "n_matched", "n_valid", "n_gt"))
        )
        for c in counts
    ]
    for key in ("f1_desc", "desc_accuracy"):
        assert iv[key].value == pytest.approx(np.mean([e[key] for e in expected]))
        assert iv[key].low <= iv[key].value <= iv[key].high
    assert iv["f1_desc"].value < iv["f1"].value  # half the hits have the wrong desc
    old = {"per_image_fields": list(FIELDS[:-1]), "per_image": [[2, 2, 1, 0, 0, 0], [2, 2, 2, 0, 0, 0]]}
    old_iv = variant_intervals([counts_from_row(old)])
    assert old_iv["f1"].value == pytest.approx(0.75)
    assert np.isnan(old_iv["f1_desc"].value) and np.isnan(old_iv["desc_accuracy"].value)
