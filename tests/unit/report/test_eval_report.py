"""`stagectl report`'s eval sections: box vs label (class-agnostic AP, desc accuracy, both F1s), the AP of
every score kind and with constant scores, the predicted-desc histogram; older evals without them still
render."""

from __future__ import annotations

from typing import Any

from stagectl.report.markdown import fmt, render_eval, train_ab_rows
from stagectl.report.sections import Figures
from stagectl.report.train_ab import summarize_eval, summarize_train_ab

OLD = {"AP": 0.2, "AP50": 0.4, "f1": 0.9, "precision": 0.9, "recall": 0.9, "n_images": 8, "per_class_ap": {}}
NEW = {
    **OLD,
    "AP_agnostic": 0.31,
    "AP50_agnostic": 0.62,
    "AP75_agnostic": 0.25,
    "AR100_agnostic": 0.4,
    "f1_box": 0.9,
    "f1_desc": 0.45,
    "precision_desc": 0.5,
    "recall_desc": 0.41,
    "desc_accuracy": 0.5,
    "pred_desc_top_share": 0.75,
    "gt_desc_top_share": 0.25,
    "score": "objectness",
    "AP_by_score": {"coord": 0.18, "objectness": 0.2, "constant": 0.17},
    "AP_constant_score": 0.17,
    "n_pred": 8,
    "num_pred_descs": 2,
    "pred_desc_top": [["red circle", 6], ["blue | square", 2]],
}


def _render(metrics: dict[str, Any]) -> str:
    return render_eval("Evaluation report", "sub", metrics, Figures(), "report")


def test_eval_report_separates_box_from_label() -> None:
    text = _render(NEW)
    assert "| AP class-agnostic (COCOeval useCats=0) | 0.31 |" in text
    assert (
        "| F1 box-only (= f1) | 0.9 |" in text
        and "| F1 desc-aware (a hit needs the right desc) | 0.45 |" in text
    )
    assert "| desc accuracy on matched pairs | 0.5 |" in text
    assert "## AP by score (used: `objectness`; `constant`: every score 1)" in text
    assert "| `coord` | 0.18 |" in text and "| `constant` | 0.17 |" in text
    assert "## Predicted descs (the 2 most common of 2)" in text
    assert "| red circle | 6 (75.0%) |" in text and "| blue \\| square | 2 (25.0%) |" in text  # cells escaped


def test_the_images_evaluated_say_when_max_samples_cut_the_split_and_ap_is_explained() -> None:
    """An eval of val2017's first 64 images (the default max_samples) read `images evaluated | 64`."""
    text = _render({**NEW, "n_images": 64, "num_available": 5000})
    assert "| images evaluated | 64 of 5000 (the first ones: data.eval.max_samples) |" in text
    assert "| images evaluated | 8 |" in _render({**NEW, "num_available": 8})
    assert "class-aware unless marked class-agnostic" in text and "IoU .50:.95" in text


def test_an_eval_written_before_the_label_metrics_still_renders() -> None:
    text = _render(OLD)
    assert "| AP | 0.2 |" in text
    assert "| AP class-agnostic" not in text and "AP by score" not in text and "Predicted descs" not in text


def test_train_ab_summary_shows_the_last_evals_label_metrics() -> None:
    rows = [{"step": 4, "f1": 0.5, "AP": 0.1}, {"step": 8, **NEW}]
    ev = summarize_eval(rows)
    assert ev is not None
    assert (ev.ap_agnostic_last, ev.ap_constant_score_last, ev.f1_desc_last) == (0.31, 0.17, 0.45)
    assert (ev.desc_accuracy_last, ev.pred_desc_top_share_last) == (0.5, 0.75)
    summary = summarize_train_ab([{"step": 0, "kind": "A", "policy_wants_b": False, "loss": 1.0}], None)
    shown = dict(train_ab_rows(summary, ev))
    assert (
        shown["held-out eval (last) AP class-agnostic / with constant scores"] == f"{fmt(0.31)} / {fmt(0.17)}"
    )
    assert shown["held-out eval (last) desc accuracy on matched pairs / F1 desc-aware"] == "0.5 / 0.45"
    old = summarize_eval([{"step": 4, "f1": 0.5, "AP": 0.1}])
    assert (
        old is not None
        and "held-out eval (last) desc accuracy on matched pairs / F1 desc-aware"
        not in dict(train_ab_rows(summary, old))
    )
