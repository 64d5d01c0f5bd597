"""Delta sync pieces: the learner's block digests (`DeltaTracker`) and the server's base-version rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stagectl.engines.fake import FakeEngine
from stagectl.weightsync.delta import DeltaTracker, bits
from stagectl.weightsync.disk import DiskReceiver
from stagectl.weightsync.errors import DeltaBaseError, WeightSyncError
from stagectl.weightsync.http import HttpReceiver
from stagectl.weightsync.receiver import WeightSync
from stagectl.weightsync.wire import Piece, encode_chunks, encode_pieces


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(64, 16, generator=g),  # 64 B rows: 4 rows per 256 B block
        "norm": torch.randn(16, generator=g),
        "scalar": torch.tensor(3.0),
        "half": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(3, 0),
    }


def test_first_plan_is_everything_then_only_changed_elements() -> None:
    tracker = DeltaTracker()
    state = _state()
    first = tracker.plan(state, 1 << 20)
    assert [p.rows for p in first.pieces] == [None] * len(state) and first.wire_bytes == first.total_bytes
    tracker.pushed(1, state, None)
    assert tracker.plan(state, 1 << 20).pieces == []  # nothing changed
    state["embed"][5, 3] += 1.0
    state["embed"][40, 0:2] -= 1.0
    state["scalar"] += 1  # one element of one: whole is cheaper than index + value
    state["norm"][:] = 0  # every element: whole
    plan = tracker.plan(state, 1 << 20)
    shapes = {p.name: (p.rows, None if p.index is None else p.index.tolist()) for p in plan.pieces}
    assert shapes == {
        "embed": (None, [5 * 16 + 3, 40 * 16, 40 * 16 + 1]),
        "norm": (None, None),
        "scalar": (None, None),
    }
    embed = next(p for p in plan.pieces if p.name == "embed")
    assert embed.index is not None and embed.index.dtype == torch.int32
    assert torch.equal(embed.tensor, state["embed"].reshape(-1)[embed.index.long()])
    assert plan.wire_bytes == 3 * (4 + 4) + 16 * 4 + 4
    tracker.pushed(2, state, plan)
    assert tracker.plan(state, 1 << 20).pieces == []
    tracker.reset()
    assert tracker.ver is None


def test_bitwise_changes_count_and_large_deltas_are_split() -> None:
    tracker = DeltaTracker()
    t = torch.zeros(1000)
    tracker.pushed(1, {"t": t}, None)
    t[999] = -0.0  # a sign bit: equal as a float, different as bytes
    (piece,) = tracker.plan({"t": t}, 1 << 20).pieces
    assert piece.index is not None and piece.index.tolist() == [999]
    t[:300] = 1.0  # 300 changed: 8 bytes each beats 4000 bytes whole; pieces of at most 800 bytes
    plan = tracker.plan({"t": t}, 800)
    assert [p.index.numel() for p in plan.pieces if p.index is not None] == [100, 100, 100, 1]
    t[:] = 2.0
    plan = tracker.plan({"t": t}, 800)  # whole, in row ranges of at most 800 bytes
    assert [p.rows for p in plan.pieces] == [(s, s + 200) for s in range(0, 1000, 200)]


def _sync(state: dict[str, torch.Tensor]) -> tuple[HttpReceiver, FakeEngine]:
    engine = FakeEngine({k: torch.zeros_like(v) for k, v in state.items()})
    return HttpReceiver(WeightSync(engine)), engine


def _push(sync: HttpReceiver, chunks: list, sync_id: str, version: int, base: int | None) -> None:
    for c in chunks:
        sync.add_chunk(sync_id, c.index, c.digest, version, c.data, base)
    sync.commit(sync_id, version, len(chunks))


def test_deltas_reach_the_state_a_full_sync_would() -> None:
    state = _state()
    sync, engine = _sync(state)
    tracker = DeltaTracker()
    _push(sync, list(encode_chunks(state, 300)), "full", 1, None)
    tracker.pushed(1, state, None)
    for version in range(2, 6):
        state["embed"][version * 7 % 64] += version  # sparse
        state["half"] *= 1.5  # whole
        state["embed"][version, 0] = float("nan")
        plan = tracker.plan(state, 300)
        assert any(p.index is not None for p in plan.pieces)
        _push(sync, list(encode_pieces(plan.pieces, 300)), f"d{version}", version, version - 1)
        tracker.pushed(version, state, plan)
        assert engine.version == version
        for name, tensor in state.items():
            assert torch.equal(bits(engine.weights[name]), bits(tensor)), name


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
    DiskReceiver(sync.sync, [tmp_path]).load_from_disk(str(tmp_path / "w.safetensors"), 2)
    with pytest.raises(DeltaBaseError, match="without a staged copy"):
        sync.add_chunk("d2", 0, chunk.digest, 3, chunk.data, base_version=2)
    assert engine.version == 2 and torch.equal(engine.weights["scalar"], state["scalar"])


def test_bad_sparse_pieces_are_refused_and_leave_the_old_weights() -> None:
    state = _state()
    sync, engine = _sync(state)
    values = torch.tensor([7.0])
    cases = [
        (torch.tensor([64 * 16], dtype=torch.int32), True, "sparse index outside"),  # one past the end
        (torch.tensor([-1], dtype=torch.int64), True, "sparse index outside"),
        (torch.tensor([0], dtype=torch.int32), False, "sent sparse in a full sync"),
    ]
    for version, (index, as_delta, message) in zip((1, 3, 5), cases, strict=True):
        _push(sync, list(encode_chunks(state, 1 << 20)), f"full{version}", version, None)
        (chunk,) = encode_pieces([Piece("embed", None, values, index=index)], 1 << 20)
        with pytest.raises(WeightSyncError, match=message):
            sync.add_chunk("bad", 0, chunk.digest, version + 1, chunk.data, version if as_delta else None)
        assert engine.version == version and torch.equal(engine.weights["embed"], state["embed"])
