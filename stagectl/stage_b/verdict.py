"""The rollout output contract (pure): exactly two non-empty lines,

    Verdict: pass | fail | 通过 | 不通过
    Reason: <one line>

Blank lines are ignored; the keywords and `pass`/`fail` are case-insensitive, and a full-width colon
`：` is accepted. Anything else is a format error: a third line, a hedged or third-state answer
("need review", 需复核, 不确定, ...) anywhere in the text, an empty reason, another verdict word.
`parse_verdict` never raises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

Verdict = Literal["pass", "fail"]
_VERDICT_WORDS: dict[str, Verdict] = {"pass": "pass", "fail": "fail", "通过": "pass", "不通过": "fail"}
_LINE = re.compile(r"^\s*(verdict|reason)\s*[:：](.*)$", re.IGNORECASE)
THIRD_STATE_MARKERS = (
    "need review",
    "needs review",
    "need_review",
    "manual review",
    "human review",
    "uncertain",
    "unsure",
    "cannot determine",
    "can't determine",
    "undetermined",
    "需复核",
    "需要复核",
    "人工复核",
    "复核",
    "不确定",
    "无法判断",
    "无法确定",
    "待定",
)


@dataclass(frozen=True)
class VerdictParse:
    verdict: Verdict | None  # None when `error` is set
    reason: str
    error: str | None  # why the text breaks the contract

    @property
    def ok(self) -> bool:
        return self.error is None


def parse_verdict(text: Any) -> VerdictParse:
    """Check one candidate against the two-line contract."""
    if not isinstance(text, str):
        return _error(f"not text ({type(text).__name__})")
    lowered = text.casefold()
    marker = next((m for m in THIRD_STATE_MARKERS if m in lowered), None)
    if marker is not None:
        return _error(f"third-state answer ({marker!r}); only pass or fail is allowed")
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) != 2:
        return _error(f"expected exactly 2 non-empty lines (Verdict, Reason), got {len(lines)}")
    first, second = _LINE.match(lines[0]), _LINE.match(lines[1])
    if first is None or first.group(1).casefold() != "verdict":
        return _error("the first line must be 'Verdict: pass|fail'")
    if second is None or second.group(1).casefold() != "reason":
        return _error("the second line must be 'Reason: <one line>'")
    word = first.group(2).strip()
    verdict = _VERDICT_WORDS.get(word.casefold())
    if verdict is None:
        return _error(f"verdict must be pass, fail, 通过 or 不通过, got {word[:40]!r}")
    reason = second.group(2).strip()
    if not reason:
        return _error("the reason is empty")
    return VerdictParse(verdict=verdict, reason=reason, error=None)


def _error(message: str) -> VerdictParse:
    return VerdictParse(verdict=None, reason="", error=message)
