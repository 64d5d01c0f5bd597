"""`variant_of`: the label that groups comparison runs into variants (seeds of one variant are pooled)."""

from __future__ import annotations

import pytest

from stagectl.report.compare import variant_of


def _config(**channel_b: object) -> dict[str, object]:
    return {"stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"target": "clean_prefix", **channel_b}}}


def test_a_only_and_plain_ab() -> None:
    assert variant_of({"stage2_ab": {"schedule": {"b_ratio": 0}}}) == "A-only"
    assert variant_of(_config()) == "AB b=0.5 clean_prefix"


@pytest.mark.parametrize(
    ("channel_b", "suffix"),
    [
        ({"insertion_order": "sorted"}, "/sorted"),
        ({"desc_ce_weight_matched": 0.5}, " desc_matched=0.5"),
        ({"desc_ce_weight_matched": 0.5, "mask_correct_matched_desc": False}, " desc_matched=0.5/unmasked"),
        ({"match": {"assignment": "greedy_iou"}}, " greedy_iou"),
        ({"match": {"desc_gated": True}}, " desc_gated"),
    ],
)
def test_knobs_off_their_defaults_name_the_variant(channel_b: dict[str, object], suffix: str) -> None:
    assert variant_of(_config(**channel_b)) == "AB b=0.5 clean_prefix" + suffix


def test_defaults_written_out_do_not_change_the_label() -> None:
    explicit = _config(
        desc_ce_weight_matched=0.0,
        mask_correct_matched_desc=True,
        match={"assignment": "hungarian", "desc_gated": False},
    )
    assert variant_of(explicit) == variant_of(_config())
