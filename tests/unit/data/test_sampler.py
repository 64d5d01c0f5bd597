"""ShardedSampler: disjoint complete shards per epoch, reshuffles, independent streams, exact resume."""

from __future__ import annotations

import pytest

from stagectl.data.sampler import ShardedSampler, epoch_permutation, share_length


def _samplers(num_samples: int, world_size: int, stream: str = "A", seed: int = 0) -> list[ShardedSampler]:
    return [
        ShardedSampler(num_samples, rank=rank, world_size=world_size, seed=seed, stream=stream)
        for rank in range(world_size)
    ]


@pytest.mark.parametrize(("num_samples", "world_size"), [(12, 1), (12, 4), (10, 3), (7, 7), (101, 8)])
def test_shards_are_disjoint_and_complete_every_epoch(num_samples: int, world_size: int) -> None:
    samplers = _samplers(num_samples, world_size)
    for epoch in range(3):
        shares = [s.take(s.share_length) for s in samplers]
        assert sorted(i for share in shares for i in share) == list(range(num_samples)), epoch
        assert [len(share) for share in shares] == [
            share_length(num_samples, r, world_size) for r in range(world_size)
        ]
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        assert all(s.epoch == epoch + 1 and s.position == 0 for s in samplers)


def test_each_epoch_is_reshuffled() -> None:
    (sampler,) = _samplers(50, 1)
    epochs = [sampler.take(50) for _ in range(4)]
    assert all(sorted(order) == list(range(50)) for order in epochs)
    assert len({tuple(order) for order in epochs}) == 4
    assert epochs[0] != list(range(50))


def test_streams_and_seeds_give_independent_orders() -> None:
    a = _samplers(64, 2, stream="A")[0].take(64)
    b = _samplers(64, 2, stream="B")[0].take(64)
    other_seed = _samplers(64, 2, stream="A", seed=1)[0].take(64)
    again = _samplers(64, 2, stream="A")[0].take(64)
    assert a == again
    assert a != b and a != other_seed
    assert epoch_permutation(64, 0, "A", 0) != epoch_permutation(64, 0, "B", 0)


def test_num_consumed_reproduces_the_stream() -> None:
    reference = ShardedSampler(10, rank=1, world_size=3, seed=4, stream="B")
    expected = reference.take(40)  # crosses several epochs of a 3-index share
    for consumed in (0, 1, 2, 3, 7, 25):
        resumed = ShardedSampler(10, rank=1, world_size=3, seed=4, stream="B", num_consumed=consumed)
        assert resumed.take(40 - consumed) == expected[consumed:]


def test_state_dict_round_trip() -> None:
    sampler = ShardedSampler(10, rank=2, world_size=4, seed=9, stream="A")
    sampler.take(5)
    state = sampler.state_dict()
    assert state["num_consumed"] == 5
    assert (state["epoch"], state["position"]) == (2, 1)  # share length 2: epochs 0 and 1 done
    expected = sampler.take(9)
    restored = ShardedSampler(10, rank=2, world_size=4, seed=9, stream="A")
    restored.load_state_dict(state)
    assert restored.take(9) == expected


@pytest.mark.parametrize(
    "changed", [{"world_size": 2, "rank": 0}, {"seed": 1}, {"stream": "B"}, {"num_samples": 11}]
)
def test_state_from_another_setup_is_refused(changed: dict[str, object]) -> None:
    state = ShardedSampler(10, rank=0, world_size=4, seed=9, stream="A").state_dict()
    args: dict[str, object] = {
        "num_samples": 10,
        "rank": 0,
        "world_size": 4,
        "seed": 9,
        "stream": "A",
        **changed,
    }
    other = ShardedSampler(**args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="resume with the same"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("num_samples", "rank", "world_size", "message"),
    [(3, 0, 4, "at least one sample"), (8, 4, 4, "rank must be"), (8, 0, 0, "world_size")],
)
def test_bad_arguments(num_samples: int, rank: int, world_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardedSampler(num_samples, rank=rank, world_size=world_size, seed=0, stream="A")
