"""`stagectl.files`: run files (config.yaml, final_state, reports) get the mode a plain `open` gives them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from stagectl.files import atomic_write_text, write_resolved_config


def test_resolved_config_follows_the_umask_not_mkstemps_0600(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        path = write_resolved_config(tmp_path / "run", {"model": {"name_or_path": "x"}})
        atomic_write_text(tmp_path / "note.txt", "ok\n")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "note.txt").stat().st_mode) == 0o644
    assert path.read_text().startswith("model:") and (tmp_path / "note.txt").read_text() == "ok\n"
