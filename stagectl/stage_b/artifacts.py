"""The JSONL artifacts of one mission run (rank 0 only), under `{output.root}/{run_name}/{mission}/`.

| file | one row per |
|---|---|
| trajectories.jsonl | candidate (with the `guidance_step` it was generated under) |
| selections.jsonl | ticket (selected verdict, vote counts, `vote_strength`, `label_match`) |
| metrics.jsonl | logging window (`runner.logging_steps` global batches) |
| reflection.jsonl | reflection step (records, accepted / dropped operations, steps before/after) |
| need_review_queue.jsonl | ticket needing a person (no well-formed candidate, weak vote) |
| failure_malformed.jsonl | candidate that broke the two-line output contract |

A fresh run truncates them; a resumed run appends, after `progress.cut_artifacts` has cut each back to the
length `progress.json` recorded at its last batch boundary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

TRAJECTORIES = "trajectories.jsonl"
SELECTIONS = "selections.jsonl"
METRICS = "metrics.jsonl"
REFLECTION = "reflection.jsonl"
NEED_REVIEW = "need_review_queue.jsonl"
MALFORMED = "failure_malformed.jsonl"
ALL_FILES = (TRAJECTORIES, SELECTIONS, METRICS, REFLECTION, NEED_REVIEW, MALFORMED)


class ArtifactWriter:
    def __init__(self, directory: Path, fresh: bool) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        mode = "w" if fresh else "a"
        self._files: dict[str, IO[str]] = {
            name: (directory / name).open(mode, encoding="utf-8") for name in ALL_FILES
        }

    def write(self, name: str, row: dict[str, Any]) -> None:
        self._files[name].write(json.dumps(row, ensure_ascii=False) + "\n")

    def flush(self) -> None:
        for handle in self._files.values():
            handle.flush()

    def lengths(self) -> dict[str, int]:
        """Bytes written to each file so far (flushed first): a batch boundary for `progress.json`."""
        self.flush()
        return {name: handle.tell() for name, handle in self._files.items()}

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
