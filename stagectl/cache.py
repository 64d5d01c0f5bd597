"""The one user cache directory of stagectl (built-in tiny models, synthetic data sets)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$STAGECTL_CACHE_DIR`, else `$XDG_CACHE_HOME/stagectl`, else `~/.cache/stagectl`."""
    if os.environ.get("STAGECTL_CACHE_DIR"):
        return Path(os.environ["STAGECTL_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "stagectl"
