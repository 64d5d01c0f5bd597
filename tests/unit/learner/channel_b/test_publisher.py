"""`WeightPublisher`'s version rule: after a push that failed part-way (some server may have committed it),
the next push goes past the highest version any server serves, so no server refuses it as not newer and
every server ends on one version; `ver` follows the version actually pushed."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from stagectl.dist import World
from stagectl.learner.channel_b.publisher import WeightPublisher
from stagectl.weightsync.errors import DeltaRefused, NotInGroup, WeightPushError
from stagectl.wire.errors import RolloutRequestError


@dataclass
class FakeClient:
    served: list[int]
    fail_next: bool = False
    pushed: list[int] = field(default_factory=list)

    def versions(self) -> list[Any]:
        return [SimpleNamespace(version=v) for v in self.served]

    def push_weights(self, state_dict: Any, version: int, base_version: int | None = None) -> Any:
        self.pushed.append(version)
        if any(version <= v for v in self.served):
            raise WeightPushError(f"target version {version} is not above the serving version")
        if self.fail_next:  # committed on server 0, the connection to server 1 broke
            self.fail_next = False
            self.served[0] = version
            raise WeightPushError("server 1 unreachable", unreachable=True)
        self.served = [version] * len(self.served)
        return SimpleNamespace(num_bytes=64, state_bytes=64, delta=False)


def test_a_partly_committed_push_is_followed_by_one_past_every_served_version() -> None:
    client = FakeClient(served=[0, 0])
    publisher = WeightPublisher(client, torch.nn.Linear(2, 2), World(0, 0, 1), num_updates=0)  # type: ignore[arg-type]
    assert publisher.ver == 0 and publisher.fresh
    first = publisher._push(publisher._state_dict())
    assert first.status == "ok" and first.version == 1
    publisher._advance(first)
    client.fail_next = True
    failed = publisher._push(publisher._state_dict())  # version 2 lands on server 0 only
    assert failed.status == "unreachable" and client.served == [2, 1] and publisher.ver == 1
    outcome = publisher._push(publisher._state_dict())  # 2 would be refused by server 0: 3 for both
    assert outcome.status == "ok" and outcome.version == 3 and client.served == [3, 3]
    publisher._advance(outcome)
    assert publisher.ver == 3 and client.pushed == [1, 2, 3]


def test_a_push_failed_by_a_dead_group_member_is_skipped_not_fatal() -> None:
    # `transport: collective`: a server dying mid-broadcast raises WeightPushError(unreachable=True)
    client = FakeClient(served=[0])
    publisher = WeightPublisher(client, torch.nn.Linear(2, 2), World(0, 0, 1), num_updates=1)  # type: ignore[arg-type]

    def dead_member(state_dict: Any, version: int, base_version: int | None = None) -> Any:
        raise WeightPushError("weight group rank 0: broadcast failed (a peer died)", unreachable=True)

    client.push_weights = dead_member  # type: ignore[method-assign]
    assert publisher._push(publisher._state_dict()).status == "unreachable"

    def refused(state_dict: Any, version: int, base_version: int | None = None) -> Any:
        raise WeightPushError("w0: shape [3, 3], the serving model has [4, 4]")

    client.push_weights = refused  # type: ignore[method-assign]
    assert publisher._push(publisher._state_dict()).status == "error"


def test_weights_leave_in_the_servers_dtype_while_the_masters_stay_float32() -> None:
    client = FakeClient(served=[0])
    model = torch.nn.Linear(2, 2)
    publisher = WeightPublisher(
        client,  # type: ignore[arg-type]
        model,
        World(0, 0, 1),
        num_updates=1,
        storage_dtype=torch.bfloat16,
    )
    state = publisher._state_dict()
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert model.weight.dtype == torch.float32
    torch.testing.assert_close(state["weight"], model.weight.detach().to(torch.bfloat16))


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (WeightPushError("a server died mid-sync", unreachable=True), "unreachable"),
        (httpx.ConnectError("refused"), "unreachable"),  # `versions()` before a push after a failed one
        (WeightPushError("w0: shape [3, 3], the serving model has [4, 4]"), "error"),
        (DeltaRefused("HTTP 409 twice"), "error"),
        (NotInGroup("HTTP 412 twice"), "error"),
        (RolloutRequestError("HTTP 401: missing or wrong bearer token"), "error"),
    ],
)
def test_the_publisher_dispatches_on_the_error_type(error: Exception, status: str) -> None:
    client = FakeClient(served=[0])
    publisher = WeightPublisher(client, torch.nn.Linear(2, 2), World(0, 0, 1), num_updates=1)  # type: ignore[arg-type]

    def failing(state_dict: Any, version: int, base_version: int | None = None) -> Any:
        raise error

    client.push_weights = failing  # type: ignore[method-assign]
    assert publisher._push(publisher._state_dict()).status == status


def test_a_refusal_caused_by_a_transport_error_is_still_a_refusal() -> None:
    """Only `unreachable` says a server was lost; the cause chain is never inspected."""
    client = FakeClient(served=[0])
    publisher = WeightPublisher(client, torch.nn.Linear(2, 2), World(0, 0, 1), num_updates=1)  # type: ignore[arg-type]

    def refused(state_dict: Any, version: int, base_version: int | None = None) -> Any:
        raise WeightPushError("HTTP 400: refused") from httpx.ConnectError("an earlier try")

    client.push_weights = refused  # type: ignore[method-assign]
    assert publisher._push(publisher._state_dict()).status == "error"


@pytest.mark.parametrize(
    ("engines", "sends_adapter"),
    [(["hf", "hf"], True), (["hf", "vllm"], False), (["hf", "swift"], False), (["fake"], False)],
)
def test_adapter_syncs_go_only_to_servers_whose_engines_all_merge_adapters(
    engines: list[str], sends_adapter: bool
) -> None:
    client = SimpleNamespace(versions=lambda: [SimpleNamespace(version=0, engine=e) for e in engines])
    publisher = WeightPublisher(
        client,  # type: ignore[arg-type]
        torch.nn.Linear(2, 2),
        World(0, 0, 1),
        num_updates=0,
        adapter_sync=True,
    )
    assert publisher.sends_adapter is sends_adapter
