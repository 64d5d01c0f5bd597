"""Guidance operations proposed by reflection (pure): validate each one, apply the safe ones.

Accepted shapes (one JSON object each, from `{"operations": [...]}` or a bare list):

    {"op": "add",    "text": "...",                "evidence": ["g1::fail", ...]}
    {"op": "update", "key": "G2", "text": "...",   "evidence": [...]}
    {"op": "delete", "key": "G2",                  "evidence": [...]}
    {"op": "merge",  "keys": ["G1", "G3"], "text": "...", "evidence": [...]}   # into the lowest key

An optional `"reason"` string is kept for the log. An operation is dropped (with its reason) when it is
malformed, touches G0 or an S* rule, names a rule that does not exist, cites evidence that is not a
ticket of the reflection batch, conflicts with an earlier operation of the same answer, or exceeds
`max_operations`, whose text or reason holds a lone surrogate escape (`\\ud83d` without its pair: a rule that
could be neither saved nor prompted), or whose text carries a third-state marker
(`verdict.THIRD_STATE_MARKERS`: a rule such as `需复核时通过。` would ask every later rollout for an answer the verdict parser rejects). A merge that
names a rule that does not exist is dropped whole (upstream merges the rules that exist; a merged text
written for rules that are gone is not trusted). An `add` whose text equals an existing rule merges into it (no new rule). A set that
would remove every learnable rule is rejected as a whole: reflection may prune rules, never wipe them.
`apply_operations` never raises, whatever it is given.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from stagectl.stage_b.guidance import (
    FOCUS_KEY,
    Guidance,
    is_learnable,
    is_read_only,
    learnable_index,
    next_learnable_key,
    normalize_text,
    ordered,
)
from stagectl.stage_b.verdict import THIRD_STATE_MARKERS
from stagectl.wire.text import LONE_SURROGATE

OpKind = Literal["add", "update", "delete", "merge"]
MAX_RULE_CHARS = 500
_NOT_TEXT = "holds a lone surrogate escape (\\ud800-\\udfff): not text"
_FIELDS: dict[str, frozenset[str]] = {
    "add": frozenset({"op", "text", "evidence", "reason"}),
    "update": frozenset({"op", "key", "text", "evidence", "reason"}),
    "delete": frozenset({"op", "key", "evidence", "reason"}),
    "merge": frozenset({"op", "keys", "text", "evidence", "reason"}),
}


@dataclass(frozen=True)
class GuidanceOp:
    op: OpKind
    keys: tuple[str, ...]  # update/delete: (key,); merge: the merged keys; add: (the new key,)
    text: str  # "" for delete
    evidence: tuple[str, ...]
    reason: str = ""


@dataclass(frozen=True)
class DroppedOp:
    op: str  # a short rendering of what was proposed
    reason: str


@dataclass(frozen=True)
class OpsOutcome:
    guidance: Guidance  # the new guidance (step + 1) when `changed`, else the input
    accepted: list[GuidanceOp] = field(default_factory=list)
    dropped: list[DroppedOp] = field(default_factory=list)
    merged_duplicates: list[tuple[str, str]] = field(default_factory=list)  # (add text, existing key)
    rejected: str | None = None  # why the whole set was refused

    @property
    def changed(self) -> bool:
        return bool(self.accepted) and self.rejected is None


def apply_operations(
    raw: Any,
    guidance: Guidance,
    evidence_keys: Collection[str],
    max_operations: int,
    now: str,
) -> OpsOutcome:
    """Validate `raw` (decoded JSON, or anything) against `guidance`; apply what is safe."""
    items = _op_list(raw)
    if items is None:
        return OpsOutcome(
            guidance, rejected='the answer must be {"operations": [...]} or a list of operations'
        )
    work = dict(guidance.experiences)
    touched: set[str] = set()
    accepted: list[GuidanceOp] = []
    dropped: list[DroppedOp] = []
    merged: list[tuple[str, str]] = []
    allowed = frozenset(k for k in evidence_keys if isinstance(k, str))
    for item in items:
        checked = _check(item, work, allowed, touched)
        if isinstance(checked, str):
            dropped.append(DroppedOp(_render(item), checked))
            continue
        duplicate = _duplicate_of(checked, work) if checked.op == "add" else None
        if duplicate is not None:
            merged.append((checked.text, duplicate))
            continue
        if len(accepted) >= max_operations:
            dropped.append(DroppedOp(_render(item), f"over reflection.max_operations ({max_operations})"))
            continue
        if checked.op == "add":
            checked = GuidanceOp(
                "add", (next_learnable_key(work),), checked.text, checked.evidence, checked.reason
            )
        _apply(checked, work)
        touched.update(checked.keys)
        accepted.append(checked)
    had_rules = any(is_learnable(k) for k in guidance.experiences)
    if accepted and had_rules and not any(is_learnable(k) for k in work):
        reason = "the operations would remove every learnable rule (G1..); none applied"
        return OpsOutcome(guidance, [], dropped, merged, rejected=reason)
    if not accepted:
        return OpsOutcome(guidance, [], dropped, merged)
    assert FOCUS_KEY in work  # G0 is never touched by `_check`
    new = Guidance(step=guidance.step + 1, updated_at=now, experiences=ordered(work))
    return OpsOutcome(new, accepted, dropped, merged)


def _op_list(raw: Any) -> Sequence[Any] | None:
    if isinstance(raw, Mapping) and isinstance(raw.get("operations"), list):
        return list(raw["operations"])
    if isinstance(raw, list):
        return raw
    return None


def _check(
    item: Any, work: Mapping[str, str], allowed: frozenset[str], touched: set[str]
) -> GuidanceOp | str:
    """A well-formed, safe operation, or why it is dropped."""
    if not isinstance(item, Mapping):
        return "an operation must be a JSON object"
    kind = item.get("op")
    if not isinstance(kind, str) or kind not in _FIELDS:
        return "op must be one of add, update, delete, merge"
    unknown = [k for k in item if not isinstance(k, str) or k not in _FIELDS[kind]]
    if unknown:
        return f"unknown field(s) for {kind}: {', '.join(_short(k) for k in unknown)}"
    reason = item.get("reason", "")
    if not isinstance(reason, str):
        return "reason must be a string"
    if LONE_SURROGATE.search(reason):
        return f"reason {_NOT_TEXT}"
    evidence = _evidence(item.get("evidence"), allowed)
    if isinstance(evidence, str):
        return evidence
    text = ""
    if kind != "delete":
        text_or_error = _text(item.get("text"))
        if text_or_error.startswith("!"):
            return text_or_error[1:]
        text = text_or_error
    if kind == "add":
        return GuidanceOp("add", (), text, evidence, reason)
    if kind == "merge":
        keys = item.get("keys")
        if not isinstance(keys, list) or len(keys) < 2 or not all(isinstance(k, str) for k in keys):
            return "merge needs keys: a list of at least two rule keys"
        if len(set(keys)) != len(keys):
            return "merge keys must be distinct"
        missing = [k for k in keys if is_learnable(k) and k not in work]
        if missing:
            return f"merge names no rule {', '.join(missing)}: the whole merge is dropped"
    else:
        key = item.get("key")
        if not isinstance(key, str):
            return f"{kind} needs key: the rule key (G1, G2, ...)"
        keys = [key]
    for key in keys:
        problem = _editable(key, work, touched)
        if problem:
            return problem
    ordered_keys = tuple(sorted(keys, key=learnable_index))
    return GuidanceOp(kind, ordered_keys, text, evidence, reason)  # type: ignore[arg-type]


def _evidence(value: Any, allowed: frozenset[str]) -> tuple[str, ...] | str:
    if not isinstance(value, list) or not value:
        return "evidence must be a non-empty list of ticket keys (group_id::label)"
    if not all(isinstance(v, str) for v in value):
        return "evidence entries must be ticket keys (strings)"
    foreign = [v for v in value if v not in allowed]
    if foreign:
        return f"evidence {_short(foreign[0])} is not a ticket of this reflection batch"
    return tuple(dict.fromkeys(value))


def _text(value: Any) -> str:
    """The normalised rule text, or `!reason` when it is unusable."""
    if not isinstance(value, str) or not value.strip():
        return "!text must be a non-empty string"
    text = normalize_text(value)
    if LONE_SURROGATE.search(text):
        return f"!text {_NOT_TEXT}"
    if len(text) > MAX_RULE_CHARS:
        return f"!text is longer than {MAX_RULE_CHARS} characters"
    folded = text.casefold()
    marker = next((m for m in THIRD_STATE_MARKERS if m in folded), None)
    if marker is not None:
        return (
            f"!text holds the third-state marker {marker!r}: a rule may lead only to pass or fail "
            "(rollout answers with a third state are format errors)"
        )
    return text


def _editable(key: str, work: Mapping[str, str], touched: set[str]) -> str:
    if key == FOCUS_KEY:
        return "G0 (the mission focus) is protected"
    if is_read_only(key):
        return f"{_short(key)} is a read-only rule (S*)"
    if not is_learnable(key):
        return f"{_short(key)} is not a learnable rule key (G1, G2, ...)"
    if key not in work:
        return f"no rule {key}"
    if key in touched:
        return f"conflicts with an earlier operation on {key}"
    return ""


def _duplicate_of(op: GuidanceOp, work: Mapping[str, str]) -> str | None:
    wanted = op.text.casefold()
    return next((k for k, text in work.items() if text.casefold() == wanted), None)


def _apply(op: GuidanceOp, work: dict[str, str]) -> None:
    if op.op in ("add", "update"):
        work[op.keys[0]] = op.text
    elif op.op == "delete":
        del work[op.keys[0]]
    else:  # merge into the lowest key
        for key in op.keys[1:]:
            del work[key]
        work[op.keys[0]] = op.text


def _short(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an integer past the int->str digit limit; deep nesting
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _render(item: Any) -> str:
    return _short(item, limit=300)
