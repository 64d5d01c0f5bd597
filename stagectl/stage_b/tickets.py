"""Stage-B tickets: one JSONL line = `{mission, group_id, label: pass|fail, per_image: {image_1: summary}}`.

`parse_ticket` checks one decoded line (pure); `load_tickets` reads the files of one mission, reports
every bad line as `file:line: problem` and skips it, and refuses a set with no usable ticket.
The ticket key is `group_id::label`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Label = Literal["pass", "fail"]
LABELS: tuple[Label, ...] = ("pass", "fail")
_IMAGE_KEY = re.compile(r"^image_(\d+)$")


@dataclass(frozen=True)
class Ticket:
    mission: str
    group_id: str
    label: Label
    per_image: tuple[tuple[str, str], ...]  # (image_k, summary), ordered by k

    @property
    def key(self) -> str:
        return f"{self.group_id}::{self.label}"


@dataclass(frozen=True)
class TicketSet:
    tickets: list[Ticket]
    problems: list[str]  # `file:line: problem` for every skipped line
    num_other_missions: int  # well-formed lines of other missions (skipped silently)


def parse_ticket(data: Any) -> Ticket:
    """One decoded JSONL line -> `Ticket`; `ValueError` naming the problem otherwise."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a ticket must be a JSON object, got {type(data).__name__}")
    missing = [k for k in ("mission", "group_id", "label", "per_image") if k not in data]
    if missing:
        raise ValueError(f"missing key(s): {', '.join(missing)}")
    extra = sorted(set(data) - {"mission", "group_id", "label", "per_image"})
    if extra:
        raise ValueError(f"unknown key(s): {', '.join(map(str, extra))}")
    mission, group_id, label, per_image = data["mission"], data["group_id"], data["label"], data["per_image"]
    if not isinstance(mission, str) or not mission:
        raise ValueError("mission must be a non-empty string")
    if not isinstance(group_id, str) or not group_id or "::" in group_id:
        raise ValueError("group_id must be a non-empty string without '::'")
    if label not in LABELS:
        raise ValueError(f"label must be 'pass' or 'fail', got {label!r}")
    if not isinstance(per_image, Mapping) or not per_image:
        raise ValueError("per_image must be a non-empty object {image_1: summary, ...}")
    items: list[tuple[int, str, str]] = []
    for name, summary in per_image.items():
        match = _IMAGE_KEY.match(str(name))
        if match is None:
            raise ValueError(f"per_image key {name!r} must look like image_1, image_2, ...")
        if not isinstance(summary, str) or not summary.strip():
            raise ValueError(f"per_image.{name} must be a non-empty string")
        items.append((int(match.group(1)), str(name), " ".join(summary.split())))
    items.sort()
    return Ticket(mission, group_id, label, tuple((name, summary) for _, name, summary in items))


def parse_ticket_lines(lines: Iterable[str], source: str, mission: str) -> TicketSet:
    """Parse JSONL text lines of one file (pure); blank lines are skipped, duplicate keys are problems."""
    tickets: list[Ticket] = []
    problems: list[str] = []
    seen: set[str] = set()
    other = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            ticket = parse_ticket(json.loads(line))
        except json.JSONDecodeError as exc:
            problems.append(f"{source}:{number}: not valid JSON ({exc.msg})")
            continue
        except ValueError as exc:
            problems.append(f"{source}:{number}: {exc}")
            continue
        if ticket.mission != mission:
            other += 1
            continue
        if ticket.key in seen:
            problems.append(f"{source}:{number}: duplicate ticket key {ticket.key!r}")
            continue
        seen.add(ticket.key)
        tickets.append(ticket)
    return TicketSet(tickets, problems, other)


def load_tickets(paths: Iterable[Path], mission: str) -> TicketSet:
    """Every usable ticket of `mission` in `paths` (in file order); `ValueError` when there is none."""
    paths = list(paths)
    tickets: list[Ticket] = []
    problems: list[str] = []
    other = 0
    seen: set[str] = set()
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"tickets: cannot read {path}: {exc.strerror or exc}") from None
        part = parse_ticket_lines(text.splitlines(), str(path), mission)
        problems += part.problems
        other += part.num_other_missions
        for ticket in part.tickets:
            if ticket.key in seen:
                problems.append(
                    f"{path}: duplicate ticket key {ticket.key!r} (first seen in an earlier file)"
                )
                continue
            seen.add(ticket.key)
            tickets.append(ticket)
    if not tickets:
        detail = f"; {len(problems)} bad line(s), first: {problems[0]}" if problems else ""
        raise ValueError(
            f"tickets: no usable ticket of mission {mission!r} in {', '.join(map(str, paths))}"
            f" ({other} line(s) of other missions){detail}"
        )
    return TicketSet(tickets, problems, other)
