"""`build_learner` trusts the plan it is given, but not a plan resolved for another world: a rank refuses
it before touching the run directory, the data or the process group."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

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


@pytest.mark.parametrize("shared", [True, False])
def test_a_multi_node_fsdp_output_dir_every_node_does_not_see_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """Rank 0 of a 2-rank world (the collectives played here): rank 1 writes its marker into the same
    directory when the filesystem is shared, into a node-local one when it is not; rank 0 sees it or
    refuses the run naming rank 1, and no marker stays."""
    from stagectl import dist
    from stagectl.learner import setup
    from stagectl.learner.setup import check_output_dir_shared

    out = tmp_path / "run"
    elsewhere = tmp_path / "node1-local"
    elsewhere.mkdir()
    monkeypatch.setattr(dist, "broadcast_object", lambda obj, src=0: obj)
    # a token starting with 0, the one in 16 this test used to fail on (see `barrier`)
    monkeypatch.setattr(setup.uuid, "uuid4", lambda: SimpleNamespace(hex="0e3f" + "a" * 28))

    def barrier() -> None:  # rank 1 touches its marker where its node sees `out`
        for mine in out.glob(".shared-check-*-0"):
            # the rank is the name's last part: `replace("-0", "-1")` also rewrote a token starting with 0
            # ("-check-0e3f...") so rank 1's marker had another name (1 run in 16 failed)
            ((out if shared else elsewhere) / (mine.name.removesuffix("-0") + "-1")).touch()

    monkeypatch.setattr(dist, "barrier", barrier)
    world = World(rank=0, local_rank=0, world_size=2)
    if shared:
        check_output_dir_shared(out, world)
    else:
        with pytest.raises(
            dist.SharedError, match=r"is not shared by every node: rank 0 cannot see what rank\(s\) 1 "
        ):
            check_output_dir_shared(out, world)
    assert [p.name for p in out.iterdir() if p.name.endswith("-0")] == []
