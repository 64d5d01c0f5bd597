"""Guidance on disk (rank 0 only): `guidance.json` plus `snapshots/`, written crash-safely.

Every save first writes a timestamped snapshot of the new version, then replaces `guidance.json`
atomically (temporary file in the same directory, fsync, `os.replace`), then prunes the snapshots to
`guidance.retention`. A crash at any point leaves a complete `guidance.json`: the old one or the new.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from stagectl.files import atomic_write_text
from stagectl.stage_b.guidance import Guidance, parse_guidance

GUIDANCE_FILE = "guidance.json"
SNAPSHOT_DIR = "snapshots"


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def read_guidance_file(path: Path) -> Guidance:
    """Load and check one guidance JSON file; `ValueError` naming the file otherwise. A UTF-8 byte-order mark
    (what Windows editors write) is skipped."""
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise ValueError(f"guidance file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read guidance {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON at line {exc.lineno}: {exc.msg}") from None
    try:
        return parse_guidance(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


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

    def restore(self, guidance: Guidance) -> None:
        """A resume: `guidance` (the one at the run's last batch boundary) becomes `guidance.json` again, and
        the snapshots of later steps (made in a batch that was cut off) go; its own snapshot stays."""
        for snapshot in self.snapshots():
            if int(snapshot.stem.rsplit("-step", 1)[1]) > guidance.step:
                snapshot.unlink()
        current = self.load()
        if current is None or current.to_json() != guidance.to_json():
            text = json.dumps(guidance.to_json(), ensure_ascii=False, indent=2) + "\n"
            atomic_write_text(self.path, text)

    def snapshots(self) -> list[Path]:
        """Oldest first (the names start with the UTC time)."""
        if not self.snapshot_dir.is_dir():
            return []
        return sorted(self.snapshot_dir.glob("guidance-*.json"))

    def _prune(self) -> None:
        for old in self.snapshots()[: -self.retention]:
            old.unlink(missing_ok=True)
