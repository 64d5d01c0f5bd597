"""Mission guidance (pure): `{step, updated_at, experiences: {G0: focus, G1..: learnable, S*: read-only}}`.

`G0` is the mission focus: required, never deleted or edited by reflection. `S*` keys are read-only
rules written by people. `G1, G2, ...` are the learnable rules that reflection may add, update, delete
or merge. `step` counts accepted changes.

A guidance file is a versioned artifact: `step` and `updated_at` are required (no default), and the
legacy `focus` key is refused with a message saying that `experiences.G0` replaces it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FOCUS_KEY = "G0"
_LEARNABLE = re.compile(r"^G([1-9][0-9]*)$")
_READ_ONLY = re.compile(r"^S[A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Guidance:
    step: int
    updated_at: str  # ISO-8601 UTC
    experiences: dict[str, str]  # key -> one-line rule, in display order

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "updated_at": self.updated_at, "experiences": dict(self.experiences)}


def is_learnable(key: str) -> bool:
    """G1, G2, ... (not G0, not S*)."""
    return _LEARNABLE.match(key) is not None


def is_read_only(key: str) -> bool:
    return _READ_ONLY.match(key) is not None


def learnable_index(key: str) -> int:
    match = _LEARNABLE.match(key)
    assert match is not None, key
    return int(match.group(1))


def next_learnable_key(experiences: Mapping[str, str]) -> str:
    """One past the highest learnable index in use (keys are never reused within one file)."""
    used = [learnable_index(k) for k in experiences if is_learnable(k)]
    return f"G{max(used, default=0) + 1}"


def normalize_text(text: str) -> str:
    """One line, single spaces: what a rule is stored as."""
    return " ".join(text.split())


def ordered(experiences: Mapping[str, str]) -> dict[str, str]:
    """Display order: G0, then G1.. by index, then S* by name."""
    learnable = sorted((k for k in experiences if is_learnable(k)), key=learnable_index)
    read_only = sorted(k for k in experiences if is_read_only(k))
    keys = [FOCUS_KEY, *learnable, *read_only] if FOCUS_KEY in experiences else [*learnable, *read_only]
    return {k: experiences[k] for k in keys}


def parse_guidance(data: Any, *, upstream_section: bool = False) -> Guidance:
    """Decoded guidance JSON -> `Guidance`; `ValueError` naming the problem otherwise. An `upstream_section`
    (one mission of upstream's multi-mission file) may also hold upstream's per-rule `metadata` (provenance
    and hit counts), which must be an object and is not carried over."""
    if not isinstance(data, Mapping):
        raise ValueError(f"guidance must be a JSON object, got {type(data).__name__}")
    if "focus" in data or (isinstance(data.get("experiences"), Mapping) and "focus" in data["experiences"]):
        raise ValueError(
            "the legacy 'focus' key is no longer read: the mission focus is experiences.G0 "
            '(move its text to "experiences": {"G0": "<focus>", ...} and remove focus)'
        )
    for name in ("step", "updated_at"):
        if name not in data:
            raise ValueError(
                f"missing key {name!r} (a guidance file is versioned: step and updated_at are required)"
            )
    step = data["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    updated_at = data["updated_at"]
    if not isinstance(updated_at, str):
        raise ValueError(f"updated_at must be a string, got {updated_at!r}")
    experiences = data.get("experiences")
    if not isinstance(experiences, Mapping):
        raise ValueError("experiences must be an object {G0: focus, G1: rule, ...}")
    out: dict[str, str] = {}
    for key, text in experiences.items():
        if key != FOCUS_KEY and not is_learnable(key) and not is_read_only(key):
            raise ValueError(f"experience key {key!r} must be G0, G1, G2, ... or S<name>")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"experiences.{key} must be a non-empty string")
        out[key] = normalize_text(text)
    if FOCUS_KEY not in out:
        raise ValueError("experiences.G0 (the mission focus) is required")
    known = {"step", "updated_at", "experiences"}
    if upstream_section:
        if not isinstance(data.get("metadata", {}), Mapping):
            raise ValueError("metadata must be an object {G1: {...}, ...}")
        known.add("metadata")
    extra = sorted(set(data) - known)
    if extra:
        raise ValueError(f"unknown key(s): {', '.join(map(str, extra))}")
    return Guidance(step=step, updated_at=updated_at, experiences=ordered(out))
