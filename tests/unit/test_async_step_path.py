"""The modules one async Channel-B step passes through, as docs/design.md ("One async Channel-B step")
lists and counts them: each must exist, and the section must name each one and state their number, so a
module renamed, merged or split makes this fail until the section is updated.
`python -m tests.unit.test_async_step_path` prints the count and today's lines."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
STEP = [
    "cli/train_ab",
    "learner/loop",
    *(
        f"learner/channel_b/{name}"
        for name in [
            "build",
            "protocol",
            "async_mode",
            "prefetcher",
            "pacing",
            "bursts",
            "queue",
            "records",
            "clock",
            "packs",
            "rollouts",
            "publisher",
            "health",
            "gallery",
        ]
    ),
    "learner/packs",
    "learner/segments",
    "inference/client",
    "inference/requests",
    "weightsync/client",
    "detection/judge",
    "detection/targets",
    "detection/canonical_targets",
    "collate",
    "packing",
    "learner/loss",
    "dist",
    "schedule",
]


def section() -> str:
    text = DESIGN.read_text(encoding="utf-8")
    start = text.index("### One async Channel-B step")
    return text[start : text.index("\n## ", start)]


def lines() -> int:
    return sum(len((REPO / "stagectl" / f"{m}.py").read_text(encoding="utf-8").splitlines()) for m in STEP)


def test_every_module_of_the_step_exists() -> None:
    assert [m for m in STEP if not (REPO / "stagectl" / f"{m}.py").is_file()] == []


def test_the_design_section_names_and_counts_the_same_modules() -> None:
    text = " ".join(section().split())
    named = {m for m in re.findall(r"`([a-z_/]+)`", text) if (REPO / "stagectl" / f"{m}.py").is_file()}
    assert named == set(STEP)
    assert f"**{len(STEP)} modules**" in text


if __name__ == "__main__":
    print(f"{len(STEP)} modules, {lines():,} lines")
