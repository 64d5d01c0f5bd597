"""Delta sync after real optimizer steps of the tiny model, over the real server app on loopback: the
delta-synced server ends bit-identical to one that received full syncs (and to the learner), sends less
when part of the model is frozen, and a delta against a base the server does not hold falls back to a
full sync."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from stagectl.engines.fake import FakeEngine, default_weights
from stagectl.models.loading import load_bundle
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.weightsync.client import WeightSyncClient
from stagectl.weightsync.wire import byte_view


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _serve(state: dict[str, torch.Tensor]) -> tuple[ThreadedServer, FakeEngine]:
    engine = FakeEngine(state)
    return ThreadedServer(build_app(RolloutService(engine, ServerSettings()))).start(), engine


def _bytes(tensor: torch.Tensor) -> bytes:
    return bytes(byte_view(tensor.detach().contiguous()))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, g: torch.Generator) -> None:
    ids = torch.randint(0, 500, (2, 24), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_delta_after_optimizer_steps_is_bit_identical_to_full(dtype: str) -> None:
    model = load_bundle("builtin:tiny-qwen2.5-vl", torch_dtype=dtype).model  # type: ignore[arg-type]
    model.train()
    for name, p in model.named_parameters():  # a frozen vision tower: blocks that never change
        p.requires_grad_("visual" not in name)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    (delta_server, delta_engine), (full_server, full_engine) = _serve(start), _serve(start)
    g = torch.Generator().manual_seed(0)
    try:
        with (
            WeightSyncClient([delta_server.url], delta=True, chunk_bytes=256 * 1024) as delta,
            WeightSyncClient([full_server.url], chunk_bytes=256 * 1024) as full,
        ):
            reports = []
            for ver in range(4):
                _step(model, optimizer, g)
                state = model.state_dict()
                reports.append(delta.push_weights(state, ver + 1, base_version=ver))
                full.push_weights(state, ver + 1)
            assert [r.delta for r in reports] == [False, True, True, True]  # the first has no base
            assert all(r.num_bytes < 0.9 * r.state_bytes for r in reports[1:])  # the frozen part stays home
            # a base the server does not hold (it moved on without this client): a full sync instead
            full_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            with WeightSyncClient([delta_server.url]) as other:
                other.push_weights(full_state, 5)
            _step(model, optimizer, g)
            fallback = delta.push_weights(model.state_dict(), 6, base_version=4)
            assert not fallback.delta and delta.counters()["delta_fallbacks"] == 1  # 409, then full
            _step(model, optimizer, g)
            assert delta.push_weights(model.state_dict(), 7, base_version=6).delta  # base 6 serves
            full.push_weights(model.state_dict(), 7)
        for name, tensor in model.state_dict().items():  # bytes, not values: -0.0 and NaN payloads count
            learner = _bytes(tensor)
            assert _bytes(delta_engine.weights[name]) == learner == _bytes(full_engine.weights[name]), name
    finally:
        delta_server.stop()
        full_server.stop()


def test_refused_large_delta_is_answered_not_cut_off() -> None:
    """The server refuses a delta at its first chunk, before reading the body; a 16 MiB chunk must still get
    its 409 (drained), not a broken pipe that the learner would count as an unreachable server."""
    weights = default_weights(num_mib=16, block_mib=16)
    server, engine = _serve(weights)
    try:
        with WeightSyncClient([server.url], delta=True, chunk_bytes=32 << 20) as delta:
            delta.push_weights(weights, 1, base_version=0)
            with WeightSyncClient([server.url]) as other:
                other.push_weights(weights, 2)
            moved = {k: v + 1 for k, v in weights.items()}  # every block changed: the delta is 16 MiB
            report = delta.push_weights(moved, 3, base_version=1)
            assert not report.delta and delta.counters()["delta_fallbacks"] == 1
        assert engine.version == 3 and torch.equal(engine.weights["block0"], moved["block0"])
    finally:
        server.stop()
