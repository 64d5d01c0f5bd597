"""Reading the JSONL files a run writes, tolerating what an interrupted run leaves behind.

A crash can tear the last line; a reader that fails on it would make the report useless exactly
when it is needed. Unreadable lines are skipped and reported by line number, never silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class JsonlRows:
    path: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)  # 1-based line numbers that were not JSON objects
    num_lines: int = 0

    def notes(self) -> list[str]:
        """One line per problem, for the report's notes section."""
        if not self.bad_lines:
            return []
        torn = self.bad_lines == [self.num_lines]
        where = ", ".join(str(n) for n in self.bad_lines[:10]) + (" ..." if len(self.bad_lines) > 10 else "")
        why = " (a torn last line: the run was probably interrupted)" if torn else ""
        return [f"`{self.path.name}`: skipped {len(self.bad_lines)} unreadable line(s): {where}{why}."]


def parse_jsonl(text: str, path: Path) -> JsonlRows:
    """Rows of `text`: every line that is a JSON object; blank lines are ignored."""
    result = JsonlRows(path=path)
    lines = text.splitlines()
    result.num_lines = len(lines)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            result.bad_lines.append(number)
            continue
        if isinstance(row, dict):
            result.rows.append(row)
        else:
            result.bad_lines.append(number)
    return result


def read_jsonl(path: Path) -> JsonlRows:
    """Rows of the file at `path`; no rows when it does not exist."""
    if not path.is_file():
        return JsonlRows(path=path)
    return parse_jsonl(path.read_text(encoding="utf-8", errors="replace"), path)
