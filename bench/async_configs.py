"""The async bench's configurations (`bench/bench_async.py` runs them, `bench/markdown_async.py` writes
their tables): a leaf, so the markdown side never imports the runner."""

from __future__ import annotations

from typing import Any

CONFIGS = {
    "b0.5": ("step", "step_pipeline", "async"),
    "example": ("step", "async"),
    "example-fenced": ("async",),
    "b1.0": ("step", "async"),
    "b1.0n40": ("step", "async"),
}
# a variant: its base config with these keys (dotted config paths) changed; compared with its own step runs
# where it has them (CONFIGS), else with its base's (a key that does nothing in step mode)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "b1.0n40": ("b1.0", {"custom.extra.rollout_matching.max_new_tokens": 40}),
    # the weight sync before in_flight_sync: it waits for the burst in flight (side by side with `example`)
    "example-fenced": ("example", {"stage2_ab.channel_b.async.in_flight_sync": False}),
}
PLACEMENTS = ("separated", "shared")
