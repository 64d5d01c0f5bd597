"""Label metrics on plain data: is the desc right where the box was found, and what does the model say?

- Desc accuracy on matched pairs: the pairs of the box-only matching the F1 uses (Hungarian, IoU >= 0.5,
  desc ignored), and of them the share whose predicted desc equals the ground truth's desc after
  `normalize_desc`.
- Desc-aware precision / recall / F1: the box-only F1 with a matched pair counted as a hit only when its
  desc is right (`n_matched_desc` instead of `n_matched`; the predictions and ground truth counted are
  the same). So `f1_desc <= f1_box`, and `n_matched_desc = desc_accuracy * n_matched`: box-found times
  label-right.
- The predicted-desc histogram, a collapse detector: the most common normalised descs of the valid
  predictions with their counts, the share of the most common one, and that share in the ground truth
  beside it (a model that says "red circle" for everything has a top share near 1 whatever the data).

`normalize_desc`: Unicode NFKC, case-folded, whitespace runs collapsed to one space, stripped. So
"Red  Circle" equals "red circle"; anything else (plurals, synonyms, punctuation) is a different desc.
Class-aware COCO AP keeps its exact-string categories (`evaluation.coco`).
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from stagectl.detection.matching import MatchResult
from stagectl.detection.serialize import BoxedObject

TOP_DESCS = 10  # descs listed in the histogram


def normalize_desc(desc: str) -> str:
    """The form two descs are compared in (module docstring)."""
    return " ".join(unicodedata.normalize("NFKC", desc).casefold().split())


def matched_desc_count(preds: Sequence[BoxedObject], gt: Sequence[BoxedObject], match: MatchResult) -> int:
    """How many of `match.pairs` (pred index, gt index) have the ground truth's desc."""
    return sum(normalize_desc(preds[p].desc) == normalize_desc(gt[g].desc) for p, g in match.pairs)


def _prf(hits: int, num_pred: int, num_gt: int) -> tuple[float, float, float]:
    precision = hits / num_pred if num_pred else 0.0
    recall = hits / num_gt if num_gt else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def label_metrics(n_matched_desc: int, n_matched: int, n_pred: int, n_gt: int) -> dict[str, float]:
    """Desc accuracy on matched pairs and the desc-aware precision / recall / F1 (module docstring)."""
    precision, recall, f1 = _prf(n_matched_desc, n_pred, n_gt)
    return {
        "desc_accuracy": n_matched_desc / n_matched if n_matched else 0.0,
        "n_matched_desc": n_matched_desc,
        "precision_desc": precision,
        "recall_desc": recall,
        "f1_desc": f1,
    }


def desc_histogram(pred_descs: Iterable[str], gt_descs: Iterable[str]) -> dict[str, Any]:
    """The predicted-desc histogram (normalised descs; module docstring)."""
    preds = Counter(normalize_desc(d) for d in pred_descs)
    gts = Counter(normalize_desc(d) for d in gt_descs)
    num_pred, num_gt = sum(preds.values()), sum(gts.values())
    top = sorted(preds.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_DESCS]  # ties: alphabetical
    return {
        "pred_desc_top": [[desc, count] for desc, count in top],
        "pred_desc_top_share": top[0][1] / num_pred if num_pred else 0.0,
        "num_pred_descs": len(preds),
        "gt_desc_top_share": max(gts.values()) / num_gt if num_gt else 0.0,
        "num_gt_descs": len(gts),
    }
