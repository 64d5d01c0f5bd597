"""The weight-sync interface, learner side, and the HTTP plumbing every sender shares.

A `WeightSender` pushes a state dict (or a `TensorStream`) to every rollout server as one version, or
raises `WeightPushError` and every server keeps serving its previous version. One sender per transport
(`weightsync.http`, `.collective`, `.disk`), chosen once by `weightsync.factory.build_sender`.
The server side of each transport is in the same module as its sender; the staging, verification and
commit they share is `weightsync.receiver.WeightSync`.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import httpx

from stagectl.weightsync.errors import DeltaRefused, NotInGroup, WeightPushError
from stagectl.weightsync.protocol import SyncResponse
from stagectl.weightsync.wire import TensorStream, WeightState
from stagectl.wire.deadline import DeadlineClient
from stagectl.wire.http import response_detail

Transport = Literal["http", "collective", "disk"]
T = TypeVar("T")
log = logging.getLogger("stagectl.weightsync")


@dataclass(frozen=True)
class PushReport:
    version: int
    transport: Transport
    num_bytes: int  # bytes sent (a delta: the changed blocks only)
    num_chunks: int
    seconds: float
    state_bytes: int = 0  # tensor bytes of the whole state dict
    delta: bool = False  # True when only changed blocks went out


@dataclass(frozen=True)
class Sent:
    """What one sender's push moved."""

    num_bytes: int
    num_chunks: int = 1
    state_bytes: int = 0
    delta: bool = False


class WeightSender(Protocol):
    transport: Transport

    def push(self, state: WeightState, version: int, base_version: int | None) -> Sent:
        """Sync `state` to every server as `version` (`base_version`: the version the servers serve, for a
        delta); `WeightPushError` on failure, with every server still on its previous weights."""
        ...

    def keeps_delta_base(self) -> bool:
        """True when this sender keeps a host copy of the whole state dict (a delta sync's base)."""
        ...

    def close(self) -> None: ...


class Servers:
    """Every rollout server's weight endpoints: one httpx client per server, a pool to call them all at
    once, the token and TLS settings. A 409 raises `DeltaRefused`, a 412 `NotInGroup`, a connection
    failure `WeightPushError(unreachable=True)`, any other non-200 `WeightPushError`."""

    def __init__(
        self,
        base_urls: Sequence[str],
        headers: dict[str, str],
        timeout: httpx.Timeout,
        tls: ssl.SSLContext | None,
        *,
        timeout_s: float,
    ) -> None:
        self.base_urls = list(base_urls)
        self.headers = headers
        self.timeout = timeout
        self.tls = tls
        self.timeout_s = timeout_s  # connecting a weight group, waiting for its members
        self.clients = [self.new_http() for _ in self.base_urls]
        self.closed = False  # set by `close`
        # the servers a push goes to (`WeightSyncClient.use_servers`: a down one is left out until it is back)
        self.active: list[int] = list(range(len(self.base_urls)))
        # one thread per server + one for reading ahead the next chunk, twice over for the group's join
        self.pool = ThreadPoolExecutor(
            max_workers=2 * len(self.base_urls) + 1, thread_name_prefix="weight-sync"
        )

    def new_http(self) -> DeadlineClient:
        # every call whole within the read timeout: a server trickling its answer cannot hold a sync
        return DeadlineClient(
            total_s=self.timeout.read, timeout=self.timeout, headers=self.headers, verify=self.tls or True
        )

    def __len__(self) -> int:
        return len(self.base_urls)

    def on_every(self, call: Callable[[int], T]) -> list[T]:
        """`call(k)` for every active server `k`, at once; the results in the order of `active`."""
        if self.closed:  # the owner closed the client during a push: no new call starts
            raise WeightPushError("the weight-sync client was closed during the push")
        futures = [self.pool.submit(call, k) for k in self.active]
        return [future.result() for future in futures]

    def get(self, k: int, path: str) -> Any:
        url = f"{self.base_urls[k]}{path}"
        try:
            response = self.clients[k].get(url)
        except httpx.TransportError as exc:
            raise WeightPushError(f"{url}: {type(exc).__name__}: {exc}", unreachable=True) from exc
        return _answer(url, response)

    def post(self, k: int, path: str, **kwargs: Any) -> Any:
        return self.post_url(f"{self.base_urls[k]}{path}", k, **kwargs)

    def post_url(self, url: str, k: int, **kwargs: Any) -> Any:
        try:
            response = self.clients[k].post(url, **kwargs)
        except httpx.TransportError as exc:
            raise WeightPushError(f"{url}: {type(exc).__name__}: {exc}", unreachable=True) from exc
        except httpx.HTTPError as exc:
            raise WeightPushError(f"{url}: {type(exc).__name__}: {exc}") from exc
        return _answer(url, response)

    def abort(self, k: int, sync_id: str) -> None:
        try:
            self.clients[k].post(f"{self.base_urls[k]}/update_weights/abort/", json={"sync_id": sync_id})
        except httpx.HTTPError as exc:  # the server discards a stale staging on the next sync anyway
            log.warning("could not abort weight sync %s on %s: %s", sync_id, self.base_urls[k], exc)

    def close(self) -> None:
        self.closed = True
        for http in self.clients:  # a call still waiting on a server ends now: closing does not wait it out
            http.abort()
        self.pool.shutdown(wait=True)
        for http in self.clients:
            http.close()


def _answer(url: str, response: httpx.Response) -> Any:
    if response.status_code == 409:
        raise DeltaRefused(f"{url}: HTTP 409: {response_detail(response)}")
    if response.status_code == 412:
        raise NotInGroup(f"{url}: HTTP 412: {response_detail(response)}")
    if response.status_code != 200:
        raise WeightPushError(f"{url}: HTTP {response.status_code}: {response_detail(response)}")
    return response.json()


def check_versions(responses: Sequence[Any], version: int) -> None:
    for response in responses:
        reported = SyncResponse.model_validate(response).version
        if reported != version:
            raise WeightPushError(f"a server reports version {reported} after a sync to {version}")


def state_bytes(state: WeightState) -> int:
    if isinstance(state, TensorStream):
        return state.num_bytes
    return sum(t.numel() * t.element_size() for t in state.values())
