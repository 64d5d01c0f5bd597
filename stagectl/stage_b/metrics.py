"""Stage-B metrics per logging window (pure): accuracy, false pass / false fail rates, throughput.

`fp_rate`: tickets labelled fail that were judged pass, over the tickets labelled fail (a false pass
lets a bad group through). `fn_rate`: tickets labelled pass judged fail, over those labelled pass.
A ticket without a verdict (no well-formed candidate) counts as wrong in `accuracy` and in neither rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stagectl.stage_b.selection import Selection


@dataclass
class MetricsWindow:
    num_tickets: int = 0
    num_correct: int = 0
    num_label_fail: int = 0
    num_label_pass: int = 0
    num_fp: int = 0
    num_fn: int = 0
    num_no_verdict: int = 0
    num_candidates: int = 0
    num_malformed: int = 0
    num_reflections: int = 0
    num_guidance_changes: int = 0

    def add(self, selection: Selection) -> None:
        self.num_tickets += 1
        self.num_correct += selection.label_match
        self.num_candidates += selection.num_pass + selection.num_fail + selection.num_malformed
        self.num_malformed += selection.num_malformed
        if selection.verdict is None:
            self.num_no_verdict += 1
        if selection.label == "fail":
            self.num_label_fail += 1
            self.num_fp += selection.verdict == "pass"
        else:
            self.num_label_pass += 1
            self.num_fn += selection.verdict == "fail"

    def row(self, elapsed_s: float) -> dict[str, Any]:
        return {
            "num_tickets": self.num_tickets,
            "accuracy": _ratio(self.num_correct, self.num_tickets),
            "fp_rate": _ratio(self.num_fp, self.num_label_fail),
            "fn_rate": _ratio(self.num_fn, self.num_label_pass),
            "num_fp": self.num_fp,
            "num_fn": self.num_fn,
            "num_no_verdict": self.num_no_verdict,
            "malformed_rate": _ratio(self.num_malformed, self.num_candidates),
            "num_reflections": self.num_reflections,
            "num_guidance_changes": self.num_guidance_changes,
            "tickets_per_s": self.num_tickets / elapsed_s if elapsed_s > 0 else None,
            "elapsed_s": round(elapsed_s, 4),
        }


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None
