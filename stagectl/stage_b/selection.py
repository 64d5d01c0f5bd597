"""Verdict selection (pure): majority vote over the well-formed candidates of one ticket.

Ties go to `fail` (`selection.tie_break`). `vote_strength` is the winning share of the well-formed
votes. A ticket without a single well-formed candidate has no verdict: it goes to the manual review
queue and counts as wrong in the accuracy, but it is not a reflection record (there is no verdict to
learn from).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stagectl.stage_b.tickets import Label
from stagectl.stage_b.verdict import Verdict


@dataclass(frozen=True)
class Selection:
    verdict: Verdict | None  # None when no candidate was well-formed
    vote_strength: float  # winning votes / well-formed candidates; 0.0 without any
    num_pass: int
    num_fail: int
    num_malformed: int
    label: Label

    @property
    def label_match(self) -> bool:
        return self.verdict == self.label

    @property
    def candidates_disagree(self) -> bool:
        return self.num_pass > 0 and self.num_fail > 0


def select_verdict(verdicts: Sequence[Verdict | None], label: Label) -> Selection:
    """`verdicts`: one entry per candidate, None for a malformed one."""
    num_pass = sum(v == "pass" for v in verdicts)
    num_fail = sum(v == "fail" for v in verdicts)
    num_malformed = len(verdicts) - num_pass - num_fail
    valid = num_pass + num_fail
    if valid == 0:
        return Selection(None, 0.0, 0, 0, num_malformed, label)
    verdict: Verdict = "pass" if num_pass > num_fail else "fail"  # tie -> fail
    strength = max(num_pass, num_fail) / valid
    return Selection(verdict, strength, num_pass, num_fail, num_malformed, label)


def needs_reflection(selection: Selection) -> bool:
    """The verdict disagrees with the label, or the candidates disagree among themselves."""
    if selection.verdict is None:
        return False
    return not selection.label_match or selection.candidates_disagree


def review_reason(selection: Selection, min_vote_strength: float) -> str | None:
    """Why the ticket goes to the manual review queue, or None."""
    if selection.verdict is None:
        return "no well-formed candidate"
    if selection.vote_strength < min_vote_strength:
        return f"vote strength {selection.vote_strength:.2f} < manual_review.min_vote_strength {min_vote_strength}"
    return None
