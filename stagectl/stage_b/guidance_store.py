"""Guidance on disk (rank 0 only): `guidance.json` plus `snapshots/`, written crash-safely.

Every save first writes a timestamped snapshot of the new version, then replaces `guidance.json`
atomically (temporary file in the same directory, fsync, `os.replace`), then prunes the snapshots to
`guidance.retention`. A crash at any point leaves a complete `guidance.json`: the old one or the new.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from stagectl.files import atomic_write_text, cwd_note
from stagectl.stage_b.guidance import Guidance, parse_guidance
from stagectl.wire.text import NOT_TEXT, holds_lone_surrogate

GUIDANCE_FILE = "guidance.json"
SNAPSHOT_DIR = "snapshots"


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def read_guidance_file(path: Path, mission: str | None = None) -> Guidance:
    """Load and check one guidance JSON file; `ValueError` naming the file otherwise. A UTF-8 byte-order mark
    (what Windows editors write) is skipped. With `mission`, upstream's multi-mission file (`{mission: {step,
    updated_at, experiences, metadata}, ...}`, its `initial_guidance.json`) gives that mission's section."""
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise ValueError(f"guidance file not found: {path}{cwd_note(path)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read guidance {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON at line {exc.lineno}: {exc.msg}") from None
    except RecursionError:
        raise ValueError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if holds_lone_surrogate(data):  # valid JSON, but not text: the prompt's tokenizer refuses it mid-run
        raise ValueError(f"{path}: {NOT_TEXT}")
    if mission is not None and _is_mission_keyed(data):
        if mission not in data:
            missions = ", ".join(map(str, data))
            raise ValueError(
                f"{path}: a guidance file of several missions ({missions}), as upstream writes it, without "
                f"mission {mission!r}: add its section or set guidance.path to a file that has it"
            )
        try:
            return parse_guidance(data[mission], upstream_section=True)
        except ValueError as exc:
            raise ValueError(f"{path}: mission {mission!r}: {exc}") from None
    try:
        return parse_guidance(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _is_mission_keyed(data: object) -> bool:
    """Upstream's layout: every top-level value is a mission's section, none of our own keys at the top."""
    return (
        isinstance(data, dict)
        and bool(data)
        and not {"step", "updated_at", "experiences", "focus"} & set(data)
        and all(isinstance(section, dict) for section in data.values())
    )


class GuidanceStore:
    def __init__(self, directory: Path, retention: int) -> None:
        self.directory = directory
        self.retention = retention
        self.path = directory / GUIDANCE_FILE
        self.snapshot_dir = directory / SNAPSHOT_DIR

    def load(self) -> Guidance | None:
        """The run's current guidance, or None when the run has none yet."""
        return read_guidance_file(self.path) if self.path.exists() else None

    def save(self, guidance: Guidance) -> Path:
        """Snapshot, then replace `guidance.json`; returns the snapshot path."""
        text = json.dumps(guidance.to_json(), ensure_ascii=False, indent=2) + "\n"
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        snapshot = self.snapshot_dir / f"guidance-{stamp}-step{guidance.step:06d}.json"
        atomic_write_text(snapshot, text)
        atomic_write_text(self.path, text)
        self._prune()
        return snapshot

    def restore(self, guidance: Guidance) -> Path | None:
        """A resume: `guidance` (the one at the run's last batch boundary) becomes `guidance.json` again, and
        the snapshots of later steps (made in a batch that was cut off) go; its own snapshot stays. A
        `guidance.json` that is neither `guidance` nor what the cut-off batch saved (a hand edit after the run
        stopped) is kept as `guidance.edited-<time>.json` first, whose path is returned (None: nothing kept)."""
        later = [s for s in self.snapshots() if int(s.stem.rsplit("-step", 1)[1]) > guidance.step]
        current = self.load()
        changed = current is None or current.to_json() != guidance.to_json()
        kept = None
        if current is not None and changed and current.to_json() not in [_saved(s) for s in later]:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
            kept = self.directory / f"guidance.edited-{stamp}.json"
            atomic_write_text(kept, self.path.read_text(encoding="utf-8"))
        for snapshot in later:
            snapshot.unlink()
        if changed:
            text = json.dumps(guidance.to_json(), ensure_ascii=False, indent=2) + "\n"
            atomic_write_text(self.path, text)
        return kept

    def snapshots(self) -> list[Path]:
        """Oldest first (the names start with the UTC time)."""
        if not self.snapshot_dir.is_dir():
            return []
        return sorted(self.snapshot_dir.glob("guidance-*.json"))

    def _prune(self) -> None:
        for old in self.snapshots()[: -self.retention]:
            old.unlink(missing_ok=True)


def _saved(snapshot: Path) -> dict[str, object] | None:
    """A snapshot's guidance as JSON data (None when it cannot be read: it then matches nothing)."""
    try:
        return read_guidance_file(snapshot).to_json()
    except ValueError:
        return None
