"""Stage-B tickets: one JSONL line = `{mission, group_id, label: pass|fail, per_image: {image_1: summary}}`, plus
what upstream's Stage-A output carries besides (`images`, `label_source`, `label_timestamp`: checked, unused).

`parse_ticket` checks one decoded line (pure); `load_tickets` reads the files of one mission and names every
bad line as `file:line: problem` (not UTF-8, not JSON, a key written twice, not a ticket, a duplicate of an
earlier ticket). Lines end at `\n` only (a `\r` before it is allowed): a summary may hold U+2028 or U+0085, as
a JSON writer with `ensure_ascii=False` leaves them, so `str.splitlines` would cut a valid line in two. A UTF-8
byte-order mark at the start of a file (what Windows editors write) is skipped. A bad line is an
error unless the run opts in to skipping them (`runner.bad_ticket_lines: skip`, which the run's log, summary
and report then state); a set with no usable ticket is always an error.
The ticket key is `group_id::label`, as upstream's ingest keys them: one group_id labelled `pass` on one line
and `fail` on another is two tickets (a group reviewed again after a fix), both used, and the run's start line
names such groups (`TicketSet.both_labels`) so a labelling slip is seen.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from stagectl.files import cwd_note
from stagectl.wire.text import NOT_TEXT, holds_lone_surrogate

Label = Literal["pass", "fail"]
LABELS: tuple[Label, ...] = ("pass", "fail")
_IMAGE_KEY = re.compile(r"^image_(\d+)$")
# what `surrogateescape` decoding makes of bytes that are not UTF-8 (valid UTF-8 never decodes to these)
_UNDECODED = re.compile("[\udc80-\udcff]")
NUM_NAMED_PROBLEMS = 5  # bad lines named in the error (the count names the rest)
SKIP_HINT = "runner.bad_ticket_lines: skip"


# keys upstream's Stage-A writes (`images`: the group's file names) or its ingest reads (`label_source`,
# `label_timestamp`): accepted as upstream writes them, checked, not used
UPSTREAM_OPTIONAL = ("images", "label_source", "label_timestamp")


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
    both_labels: list[str]  # `group_id (file:line and file:line)` for each group labelled pass and fail


def parse_ticket(data: Any) -> Ticket:
    """One decoded JSONL line -> `Ticket`; `ValueError` naming the problem otherwise."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a ticket must be a JSON object, got {type(data).__name__}")
    missing = [k for k in ("mission", "group_id", "label", "per_image") if k not in data]
    if missing:
        raise ValueError(f"missing key(s): {', '.join(missing)}")
    extra = sorted(set(data) - {"mission", "group_id", "label", "per_image", *UPSTREAM_OPTIONAL})
    if extra:
        raise ValueError(f"unknown key(s): {', '.join(map(str, extra))}")
    _check_upstream_optional(data)
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


def _check_upstream_optional(data: Mapping[str, Any]) -> None:
    images = data.get("images", [])
    if not isinstance(images, list) or not all(isinstance(name, str) and name for name in images):
        raise ValueError("images must be a list of file names (as upstream's Stage-A writes it)")
    for key in ("label_source", "label_timestamp"):
        if key in data and not isinstance(data[key], str | None):
            raise ValueError(f"{key} must be a string, got {type(data[key]).__name__}")


def parse_ticket_lines(
    lines: Iterable[str], source: str, mission: str, seen: dict[str, str] | None = None
) -> TicketSet:
    """Parse JSONL text lines of one file (pure); blank lines are skipped, duplicate ticket keys are problems.
    `seen` (ticket key -> `file:line`) carries the tickets of earlier files."""
    tickets: list[Ticket] = []
    problems: list[str] = []
    both: list[str] = []
    seen = {} if seen is None else seen
    other = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        undecoded = _UNDECODED.search(line)
        if undecoded is not None:
            byte = len(line[: undecoded.start()].encode("utf-8", "surrogateescape")) + 1
            problems.append(f"{where}: not UTF-8 text (byte {byte} of the line)")
            continue
        try:
            ticket = parse_ticket(_decode_line(line))
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: not valid JSON ({exc.msg})")
            continue
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if ticket.mission != mission:
            other += 1
            continue
        if ticket.key in seen:
            problems.append(f"{where}: duplicate ticket key {ticket.key!r} (first at {seen[ticket.key]})")
            continue
        other_label = "fail" if ticket.label == "pass" else "pass"
        if f"{ticket.group_id}::{other_label}" in seen:
            both.append(f"{ticket.group_id} ({seen[f'{ticket.group_id}::{other_label}']} and {where})")
        seen[ticket.key] = where
        tickets.append(ticket)
    return TicketSet(tickets, problems, other, both)


def _decode_line(line: str) -> Any:
    """One line's JSON; `ValueError` for JSON nested too deeply for the reader (a `RecursionError` otherwise
    ends the run with a traceback) and for a string holding a lone surrogate escape (`\\ud83d` without its
    pair: valid JSON, but not text; the prompt's tokenizer and the UTF-8 artifacts refuse it mid-run)."""
    try:
        data = json.loads(line, object_pairs_hook=_no_repeated_keys)
    except RecursionError:
        raise ValueError("not valid JSON (nested too deeply)") from None
    if holds_lone_surrogate(data):
        raise ValueError(NOT_TEXT)
    return data


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all distinct (`json.loads` would keep the last of a repeated key silently:
    `"label": "pass", ..., "label": "fail"` must not become a fail ticket unseen)."""
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"key(s) written twice in one object: {', '.join(repeated)}")
    return dict(pairs)


def split_ticket_text(data: bytes) -> list[str]:
    """A ticket file's bytes -> its lines (pure): a leading byte-order mark skipped, split at `\n` only, bytes
    that are not UTF-8 kept as `surrogateescape` characters for `parse_ticket_lines` to report."""
    text = data.decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")
    return text.split("\n")


def load_tickets(paths: Iterable[Path], mission: str, *, skip_bad: bool = False) -> TicketSet:
    """Every ticket of `mission` in `paths` (in file order). `ValueError` naming the bad lines when there are
    any (unless `skip_bad`: they are in `problems`), and when no usable ticket is left."""
    paths = list(paths)
    tickets: list[Ticket] = []
    problems: list[str] = []
    other = 0
    both: list[str] = []
    seen: dict[str, str] = {}
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"tickets: cannot read {path}: {exc.strerror or exc}{cwd_note(path)}") from None
        part = parse_ticket_lines(split_ticket_text(data), str(path), mission, seen)
        problems += part.problems
        other += part.num_other_missions
        tickets += part.tickets
        both += part.both_labels
    if problems and not skip_bad:
        more = len(problems) - NUM_NAMED_PROBLEMS
        listed = "; ".join(problems[:NUM_NAMED_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")
        raise ValueError(
            f"tickets: {len(problems)} bad line(s) of mission {mission!r}: {listed}. Fix or remove them, or set "
            f"{SKIP_HINT} to run without them (the run's summary and report then say so)"
        )
    if not tickets:
        detail = f"; {len(problems)} bad line(s), first: {problems[0]}" if problems else ""
        raise ValueError(
            f"tickets: no usable ticket of mission {mission!r} in {', '.join(map(str, paths))}"
            f" ({other} line(s) of other missions){detail}"
        )
    return TicketSet(tickets, problems, other, both)
