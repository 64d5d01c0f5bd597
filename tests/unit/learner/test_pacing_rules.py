"""The async prefetcher's pacing rules come from the run's config (`learner.channel_b_async.pacing_rules`)."""

from __future__ import annotations

import math
from pathlib import Path

from stagectl.config import load_config
from stagectl.config.fractions import as_fraction
from stagectl.config.stage2_ab import AsyncConfig
from stagectl.learner.channel_b_async import pacing_rules

EXAMPLE = Path(__file__).parents[3] / "examples" / "tiny" / "train_ab_async.yaml"


def test_pacing_rules_read_the_async_keys_and_the_schedule() -> None:
    cfg = load_config(EXAMPLE)
    rules = pacing_rules(cfg, gas=2)
    assert as_fraction(rules.b_ratio) == as_fraction("1/2")
    assert (rules.gas, rules.sync_every_steps, rules.version_window, rules.target_packs) == (2, 2, 1, 4)
    assert rules.max_steps == 16
    assert rules.pack_tokens == math.ceil(cfg.training.packing_min_fill_ratio * cfg.packing_length)
    # the example builds no pack past the next sync (its learner is the bottleneck); the default does
    assert rules.past_sync is False
    assert AsyncConfig().prefetch_past_sync is True
    assert pacing_rules(
        load_config(EXAMPLE, ["stage2_ab.channel_b.async.prefetch_past_sync=true"]), 2
    ).past_sync
    assert (
        pacing_rules(
            load_config(EXAMPLE, ["stage2_ab.channel_b.async.sync_every_steps=1"]), 2
        ).sync_every_steps
        == 1
    )
