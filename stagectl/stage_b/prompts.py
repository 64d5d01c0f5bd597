"""Prompt text (pure): the rollout prompt (guidance + summaries, never the label) and the reflection
prompt (guidance + the queued records, asking for strict JSON operations).

Stage-A summaries can carry review notes (`需复核,备注: ...`, "needs review, note: ..."). Both prompts show
a summary through `prompt_summary`: `需复核,备注:` becomes `备注:` (as upstream builds its Stage-B prompt) and
any other review marker (`需复核`, `需要复核`, `人工复核`, `复核`) is removed, so the prompt never shows the
third-state wording that `verdict.parse_verdict` rejects in an answer.

Messages are plain chat messages `{"role": "system"|"user", "content": str}` that any chat template
(or the rollout server) accepts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from stagectl.stage_b.guidance import Guidance
from stagectl.stage_b.tickets import Ticket

Message = dict[str, str]
_REVIEW_NOTE = re.compile(r"(?:需要|需)复核\s*[,，、;；]?\s*备注\s*([:：])")
_REVIEW_MARKER = re.compile(r"(?:需要|需|人工)?复核\s*[,，、;；:：]?\s*")

ROLLOUT_SYSTEM = (
    "You review a group of images through their text summaries and decide whether the group passes "
    "the mission, following the guidance rules.\n"
    "Answer with exactly two lines and nothing else:\n"
    "Verdict: pass   (or: Verdict: fail)\n"
    "Reason: <one line>"
)

REFLECTION_SYSTEM = (
    "You maintain the guidance rules of a review mission. Some tickets were judged wrongly or "
    "inconsistently. Propose at most {max_ops} edits to the learnable rules (G1, G2, ...). G0 and S* rules "
    "are fixed. Answer with strict JSON only, no prose:\n"
    '{{"operations": [\n'
    '  {{"op": "add", "text": "<rule>", "evidence": ["<ticket key>", ...]}},\n'
    '  {{"op": "update", "key": "G2", "text": "<rule>", "evidence": [...]}},\n'
    '  {{"op": "delete", "key": "G3", "evidence": [...]}},\n'
    '  {{"op": "merge", "keys": ["G1", "G4"], "text": "<rule>", "evidence": [...]}}\n'
    "]}}\n"
    "Evidence must be ticket keys listed below. Return an empty list when no edit is needed."
)


@dataclass(frozen=True)
class ReflectionRecord:
    """One queued ticket as the reflection step sees it."""

    ticket: Ticket
    verdict: str | None  # the selected verdict
    num_pass: int
    num_fail: int
    reasons: tuple[str, ...]  # reasons of the well-formed candidates


def prompt_summary(summary: str) -> str:
    """A Stage-A summary without its review markers (see the module docstring)."""
    return _REVIEW_MARKER.sub("", _REVIEW_NOTE.sub(r"备注\1", summary)).strip()


def render_guidance(guidance: Guidance) -> str:
    return "\n".join(f"[{key}] {text}" for key, text in guidance.experiences.items())


def rollout_messages(guidance: Guidance, ticket: Ticket, mission: str) -> list[Message]:
    summaries = "\n".join(f"{name}: {prompt_summary(summary)}" for name, summary in ticket.per_image)
    user = f"Mission: {mission}\nGuidance:\n{render_guidance(guidance)}\n\nImage summaries:\n{summaries}"
    return [{"role": "system", "content": ROLLOUT_SYSTEM}, {"role": "user", "content": user}]


def reflection_messages(
    guidance: Guidance, records: Sequence[ReflectionRecord], mission: str, max_operations: int
) -> list[Message]:
    lines = []
    for record in records:
        ticket = record.ticket
        entry = {
            "ticket": ticket.key,
            "label": ticket.label,
            "model_verdict": record.verdict,
            "votes": {"pass": record.num_pass, "fail": record.num_fail},
            "summaries": {name: prompt_summary(summary) for name, summary in ticket.per_image},
            "model_reasons": list(record.reasons[:3]),
        }
        lines.append(json.dumps(entry, ensure_ascii=False))
    user = (
        f"Mission: {mission}\nGuidance (step {guidance.step}):\n{render_guidance(guidance)}\n\n"
        "Tickets (label = the human decision):\n" + "\n".join(lines)
    )
    system = REFLECTION_SYSTEM.format(max_ops=max_operations)
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
