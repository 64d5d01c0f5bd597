"""Delta sync pieces: the learner's block digests (`DeltaTracker`) and the server's base-version rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stagectl.rollout.delta import DeltaTracker, block_digests
from stagectl.rollout.engines.fake import FakeEngine
from stagectl.rollout.sync import WeightSync
from stagectl.rollout.weights import DeltaBaseError, encode_chunks, encode_pieces


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(64, 16, generator=g),  # 64 B rows: 4 rows per 256 B block
        "norm": torch.randn(16, generator=g),
        "scalar": torch.tensor(3.0),
        "half": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(3, 0),
    }


def test_first_plan_is_everything_then_only_changed_blocks() -> None:
    tracker = DeltaTracker(block_bytes=256)
    state = _state()
    first = tracker.plan(state)
    assert [p.rows for p in first.pieces] == [None] * len(state) and first.changed_bytes == first.total_bytes
    tracker.pushed(1, first)
    assert tracker.plan(state).pieces == []  # nothing changed
    state["embed"][5, 3] += 1.0  # block 1 (rows 4..8)
    state["embed"][40:50] -= 1.0  # blocks 10..12 (rows 40..52), one run
    state["scalar"] += 1
    plan = tracker.plan(state)
    assert [(p.name, p.rows) for p in plan.pieces] == [
        ("embed", (4, 8)),
        ("embed", (40, 52)),
        ("scalar", None),
    ]
    assert plan.changed_bytes == (4 + 12) * 64 + 4
    tracker.reset()
    assert tracker.ver is None and len(tracker.plan(state).pieces) == len(state)


def test_block_digests_see_every_byte() -> None:
    t = torch.zeros(10, 4)
    before = block_digests(t, 32)
    assert len(before) == 5  # 16 B rows, 2 rows per block
    t[9, 3] = -0.0  # a sign bit: equal as a float, different as bytes
    after = block_digests(t, 32)
    assert [a != b for a, b in zip(before, after, strict=True)] == [False] * 4 + [True]


def _sync(state: dict[str, torch.Tensor]) -> tuple[WeightSync, FakeEngine]:
    engine = FakeEngine({k: torch.zeros_like(v) for k, v in state.items()})
    return WeightSync(engine, []), engine


def _push(sync: WeightSync, chunks: list, sync_id: str, version: int, base: int | None) -> None:
    for c in chunks:
        sync.add_chunk(sync_id, c.index, c.digest, version, c.data, base)
    sync.commit(sync_id, version, len(chunks))


def test_deltas_reach_the_state_a_full_sync_would() -> None:
    state = _state()
    sync, engine = _sync(state)
    tracker = DeltaTracker(block_bytes=256)
    plan = tracker.plan(state)
    _push(sync, list(encode_chunks(state, 300)), "full", 1, None)
    tracker.pushed(1, plan)
    for version in range(2, 6):
        state["embed"][version * 7 % 64] += version
        state["half"] *= 1.5
        plan = tracker.plan(state)
        _push(sync, list(encode_pieces(plan.pieces, 300)), f"d{version}", version, version - 1)
        tracker.pushed(version, plan)
        assert engine.version == version
        for name, tensor in state.items():
            assert torch.equal(engine.weights[name], tensor), name


def test_delta_against_another_base_is_refused(tmp_path: Path) -> None:
    state = _state()
    sync, engine = _sync(state)
    _push(sync, list(encode_chunks(state, 1 << 20)), "full", 1, None)
    (chunk,) = encode_chunks({"scalar": torch.tensor(9.0)}, 1 << 20)
    with pytest.raises(
        DeltaBaseError, match=r"against base version 0 refused.*serving version 1.*send a full sync"
    ):
        sync.add_chunk("d", 0, chunk.digest, 2, chunk.data, base_version=0)
    # a disk load leaves no staged copy of what serves: a delta on top of it is refused too
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "w.safetensors"))
    sync.weight_dirs = [tmp_path]
    sync.load_from_disk(str(tmp_path / "w.safetensors"), 2)
    with pytest.raises(DeltaBaseError, match="without a staged copy"):
        sync.add_chunk("d2", 0, chunk.digest, 3, chunk.data, base_version=2)
    assert engine.version == 2 and torch.equal(engine.weights["scalar"], state["scalar"])
