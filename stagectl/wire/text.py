"""Decoded JSON that is not text: a `\\ud83d` escape without its pair is valid JSON, and `json.loads` and
pydantic's `str` let it through, but it cannot be encoded as UTF-8, so a tokenizer, a prompt or a file
written later fails on it mid-run. Every reader of outside JSON (a data line, a ticket, a guidance file, a
request, a model's answer) refuses it where it reads it, with `NOT_TEXT`."""

from __future__ import annotations

import json
import re
from typing import Any

# a lone UTF-16 surrogate: what a `\ud83d` escape without its pair decodes to (a pair decodes to one character)
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
NOT_TEXT = "a string holds a lone surrogate escape (\\ud800-\\udfff); not valid text"


def holds_lone_surrogate(data: Any) -> bool:
    """Whether a string of JSON data `data` (as `json.loads` returns it, keys included) holds a lone surrogate:
    json's C encoder walks it, fast enough for every line of a data set."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def lone_surrogate_at(value: Any, where: str = "") -> str | None:
    """Where a string in `value` (a str, or one inside its lists and dicts, keys included) holds a lone
    surrogate, e.g. `[0] ['text'] character 3`; None if none. Other values (numbers, None, models that checked
    their own fields) hold none."""
    if isinstance(value, str):
        match = LONE_SURROGATE.search(value)
        return None if match is None else f"{where}character {match.start()}".lstrip()
    if isinstance(value, list | tuple):
        items = [(f"[{i}]", item) for i, item in enumerate(value)]
    elif isinstance(value, dict):
        items = [(f"key {key!r}", key) for key in value] + [
            (f"[{key!r}]", item) for key, item in value.items()
        ]
    else:
        return None
    for label, item in items:
        found = lone_surrogate_at(item, f"{where}{label} ")
        if found is not None:
            return found
    return None
