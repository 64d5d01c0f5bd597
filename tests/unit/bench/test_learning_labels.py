"""The learning section's box-vs-label lines (`bench.markdown._label_lines`): one per metric the eval rows
had, each variant's mean over seeds with its range; results from before these metrics print none."""

from __future__ import annotations

from bench.markdown import LABEL_NAMES, _label_lines


def test_label_lines_name_each_metric_and_every_variant() -> None:
    labels = {
        "AP_agnostic": {
            "A-only": {"mean": 0.256, "min": 0.25, "max": 0.26},
            "AB": {"mean": 0.294, "min": 0.29, "max": 0.3},
        },
        "desc_accuracy": {"A-only": {"mean": 0.54, "min": 0.54, "max": 0.54}},
    }
    lines = _label_lines(labels)
    assert lines[0] == (
        f"{LABEL_NAMES['AP_agnostic']} at that step, mean over seeds [min, max]: "
        "A-only 0.256 [0.250, 0.260], AB 0.294 [0.290, 0.300]"
    )
    assert lines[2].startswith(LABEL_NAMES["desc_accuracy"]) and lines[2].endswith(
        "A-only 0.540 [0.540, 0.540]"
    )
    assert lines[1] == lines[3] == "" and _label_lines({}) == []
