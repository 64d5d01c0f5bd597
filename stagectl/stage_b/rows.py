"""The rows one judged ticket writes, as a pure function of its candidates (no I/O, no state)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stagectl.config.plan_stage_b import GridEntry
from stagectl.stage_b.selection import Selection, needs_reflection, review_reason, select_verdict
from stagectl.stage_b.tickets import Ticket
from stagectl.stage_b.verdict import VerdictParse, parse_verdict


@dataclass(frozen=True)
class Candidate:
    position: int  # index of the ticket inside its global batch
    grid_index: int
    sample_index: int
    seed: int
    rank: int
    text: str


@dataclass(frozen=True)
class TicketRows:
    """Everything one ticket contributes: artifact rows, its selection and what reflection may read."""

    selection: Selection
    selection_row: dict[str, Any]
    trajectories: list[dict[str, Any]] = field(default_factory=list)
    malformed: list[dict[str, Any]] = field(default_factory=list)
    review: dict[str, Any] | None = None
    queued_for_reflection: bool = False
    reasons: tuple[str, ...] = ()


def ticket_rows(
    ticket: Ticket,
    candidates: Sequence[Candidate],
    grid: Sequence[GridEntry],
    where: dict[str, Any],
    min_vote_strength: float,
) -> TicketRows:
    """Parse, select and lay out the rows of one ticket (`candidates` in grid, then sample order)."""
    parses: list[VerdictParse] = [parse_verdict(c.text) for c in candidates]
    ids = {"ticket_key": ticket.key, "group_id": ticket.group_id, "label": ticket.label}
    trajectories, malformed = [], []
    for c, parsed in zip(candidates, parses, strict=True):
        entry = grid[c.grid_index]
        row = {
            **where,
            **ids,
            "rank": c.rank,
            "grid_index": c.grid_index,
            "sample_index": c.sample_index,
            "seed": c.seed,
            "temperature": entry.spec.temperature,
            "top_p": entry.spec.top_p,
            "text": c.text,
            "verdict": parsed.verdict,
            "reason": parsed.reason,
            "format_error": parsed.error,
        }
        trajectories.append(row)
        if not parsed.ok:
            malformed.append(row)
    selection = select_verdict([p.verdict for p in parses], ticket.label)
    queued = needs_reflection(selection)
    selection_row = {
        **where,
        **ids,
        "rank": candidates[0].rank if candidates else None,
        "verdict": selection.verdict,
        "vote_strength": selection.vote_strength,
        "num_pass": selection.num_pass,
        "num_fail": selection.num_fail,
        "num_malformed": selection.num_malformed,
        "label_match": selection.label_match,
        "candidates_disagree": selection.candidates_disagree,
        "queued_for_reflection": queued,
    }
    reason = review_reason(selection, min_vote_strength)
    review = None if reason is None else {**where, **ids, "reason": reason, "verdict": selection.verdict}
    return TicketRows(
        selection=selection,
        selection_row=selection_row,
        trajectories=trajectories,
        malformed=malformed,
        review=review,
        queued_for_reflection=queued,
        reasons=tuple(p.reason for p in parses if p.ok),
    )
