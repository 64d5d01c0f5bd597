"""`Check`: one line of the doctor's report (ok / warn / fail / skip, what was found, the fix), its text and
JSON forms, and the exit code (pure: no torch, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

Status = Literal["ok", "warn", "fail", "skip"]


@dataclass(frozen=True)
class Check:
    name: str  # dotted, e.g. "data.images", "server[0].auth"
    status: Status
    message: str  # what was found
    fix: str = ""  # what to do (warn / fail)

    def line(self) -> str:
        fix = f" | fix: {self.fix}" if self.fix and self.status in ("warn", "fail") else ""
        return f"{self.status.upper():<4}  {self.name}: {self.message}{fix}"


def ok(name: str, message: str) -> Check:
    return Check(name, "ok", message)


def warn(name: str, message: str, fix: str) -> Check:
    return Check(name, "warn", message, fix)


def fail(name: str, message: str, fix: str) -> Check:
    return Check(name, "fail", message, fix)


def skip(name: str, message: str) -> Check:
    return Check(name, "skip", message)


def exit_code(checks: Sequence[Check]) -> int:
    """0 when no check failed (warnings included), 1 otherwise."""
    return 1 if any(c.status == "fail" for c in checks) else 0


def summary(checks: Sequence[Check]) -> str:
    counts = {s: sum(1 for c in checks if c.status == s) for s in ("ok", "warn", "fail", "skip")}
    verdict = "FAILED" if exit_code(checks) else "passed"
    return f"doctor {verdict}: " + ", ".join(f"{n} {s}" for s, n in counts.items())


def to_json(checks: Sequence[Check], seconds: float) -> dict[str, Any]:
    return {
        "ok": exit_code(checks) == 0,
        "seconds": round(seconds, 2),
        "checks": [asdict(c) for c in checks],
    }
