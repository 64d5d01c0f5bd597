"""`runner.engine: rules`: a deterministic rule engine that answers from the guidance it was given.

No model, no randomness beyond the given seed, so runs are reproducible across world sizes. It reads
the first word of each image summary as that image's attribute (`red triangle near the top` -> `red`).

Judging: every rule of the form `<word> means fail` (any experience key) makes a ticket fail when one
of its images has that attribute; otherwise the ticket passes. A ticket with an `unreadable` summary
gets a third-state answer (a format error); one with an `ambiguous` summary gets pass or fail by the
parity of the decode seed (so candidates disagree).

Reflection: among the records labelled fail but judged pass, the attribute found in most of them
(ties: alphabetical; attributes of records labelled pass do not count) becomes `add "<attribute> means fail"`, with those tickets as evidence. Every
answer also carries one unsafe operation (`delete G0`) that the validator must drop.

It is a product feature for dry runs (a mission's tickets, guidance and artifacts end to end in
seconds, no model) and the engine the Stage-B tests run on; it has no fault knobs (the test suite
injects its faults from outside).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence

from stagectl.config.sampling import SamplingSpec
from stagectl.stage_b.engine import JudgeRequest, ReflectRequest
from stagectl.stage_b.guidance import Guidance
from stagectl.stage_b.tickets import Ticket

_RULE = re.compile(r"\b([a-z]+) means fail\b", re.IGNORECASE)


class RulesBackend:
    """The same answers on every rank and every run: a function of ticket, guidance and seed."""

    def judge(self, requests: Sequence[JudgeRequest], spec: SamplingSpec, seed: int) -> list[str]:
        return [_judge_one(request.ticket, request.guidance, seed) for request in requests]

    def reflect(self, request: ReflectRequest, spec: SamplingSpec, seed: int) -> str:
        false_pass = [r.ticket for r in request.records if r.ticket.label == "fail" and r.verdict == "pass"]
        seen_in_pass = {
            attr for r in request.records if r.ticket.label == "pass" for attr in attributes(r.ticket)
        }
        counts = Counter(attr for t in false_pass for attr in set(attributes(t)) if attr not in seen_in_pass)
        operations: list[dict[str, object]] = []
        if counts:
            best = min(counts, key=lambda attr: (-counts[attr], attr))
            evidence = [t.key for t in false_pass if best in attributes(t)]
            operations.append({"op": "add", "text": f"{best} means fail", "evidence": evidence})
        keys = [r.ticket.key for r in request.records]
        operations.append({"op": "delete", "key": "G0", "evidence": keys[:1]})
        return json.dumps({"operations": operations})

    def close(self) -> None:
        """Nothing to release."""


def attributes(ticket: Ticket) -> list[str]:
    """The first word of each image summary, lower-cased."""
    return [summary.split()[0].casefold() for _, summary in ticket.per_image]


def fail_words(guidance: Guidance) -> dict[str, str]:
    """Attribute -> the key of the first rule `<attribute> means fail`."""
    words: dict[str, str] = {}
    for key, text in guidance.experiences.items():
        for match in _RULE.finditer(text):
            words.setdefault(match.group(1).casefold(), key)
    return words


def _judge_one(ticket: Ticket, guidance: Guidance, seed: int) -> str:
    summaries = " ".join(summary for _, summary in ticket.per_image).casefold()
    if "unreadable" in summaries:
        return "Verdict: need review\nReason: an image summary is unreadable"
    if "ambiguous" in summaries:
        verdict = "pass" if seed % 2 == 0 else "fail"
        return f"Verdict: {verdict}\nReason: ambiguous summary, decided by seed {seed}"
    rules = fail_words(guidance)
    hits = [attr for attr in attributes(ticket) if attr in rules]
    if hits:
        return f"Verdict: fail\nReason: {hits[0]} matches rule {rules[hits[0]]}"
    return "Verdict: pass\nReason: no rule matched"
