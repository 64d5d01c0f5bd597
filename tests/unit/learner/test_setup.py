"""`build_learner` trusts the plan it is given, but not a plan resolved for another world: a rank refuses
it before touching the run directory, the data or the process group."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagectl.config import load_config
from stagectl.config.plan_train import train_plan
from stagectl.dist import World
from stagectl.learner.setup import build_learner

ROOT = Path(__file__).resolve().parents[3]


def test_a_plan_resolved_for_another_world_size_is_refused_first(tmp_path: Path) -> None:
    out = tmp_path / "run"
    sets = [f"training.output_dir={out}", "stage2_ab.channel_b.mode=async"]
    sets += [
        "custom.extra.rollout_matching.rollout_backend=vllm",
        "custom.extra.rollout_matching.vllm.mode=server",
    ]
    sets += ["custom.extra.rollout_matching.vllm.server.servers=[{base_url: 'http://127.0.0.1:9'}]"]
    plan = train_plan(load_config(ROOT / "examples/tiny/train_ab.yaml", sets, world_size=2), world_size=2)
    with pytest.raises(ValueError, match=r"resolved for 2 learner rank\(s\) but this run has 1"):
        build_learner(plan, World(rank=0, local_rank=0, world_size=1))
    assert not out.exists()  # refused before the run directory is prepared
