"""`stagectl stage-b` argument helpers (the command itself is exercised in tests/integration)."""

from __future__ import annotations

import pytest

from stagectl.cli.stage_b import parse_gpus
from stagectl.dist import World
from stagectl.stage_b.engine import rank_device


def test_parse_gpus() -> None:
    assert parse_gpus("0") == ["0"]
    assert parse_gpus("0, 1,3") == ["0", "1", "3"]


@pytest.mark.parametrize("text", ["", "a", "0,,1", "-1", "0,0", "0;1"])
def test_parse_gpus_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="--gpus"):
        parse_gpus(text)


def test_each_rank_holds_the_full_model_on_its_local_device() -> None:
    assert rank_device(World(rank=5, local_rank=1, world_size=8), cuda_available=True) == "cuda:1"
    assert rank_device(World(rank=0, local_rank=0, world_size=1), cuda_available=True) == "cuda:0"
    assert rank_device(World(rank=1, local_rank=1, world_size=2), cuda_available=False) == "cpu"
