"""`RolloutClient`: the learner's side of the rollout-server protocol (httpx).

- `wait_healthy()` polls `/health/` on every server until `timeout_s`.
- `infer(requests, config)` spreads the requests over the servers in contiguous chunks (in parallel)
  and reassembles the responses in order. A failed call (connection error, timeout, 5xx) is retried
  once on a fresh connection, then the chunk is split in halves recursively down to single requests.
  Each piece is sent with `seed + offset`, so every request keeps seed `config.seed + its index`
  however the chunk was cut (see `protocol.py`). 4xx answers are the caller's mistake: raised at once.
- A server that is gone (its retry also fails to connect, or the connection drops) is marked down at
  once (`active` loses it until the next `use_servers`) and its share of the call is re-sent, whole and
  with the same seeds and `weight_version`, to another active server (`failovers`). The version rule
  holds: that server answers only at the call's version (`WrongVersionError` otherwise, as for any
  call). With no other server left the call fails (`RolloutServerError`).

Inference only: the weight sync to the servers is `weightsync.client.WeightSyncClient`.

The token (when given) goes on every request but `/health/`. `https://` servers are verified against
the system's trust store or `tls_ca_file`, and only left unverified with `tls_skip_verify`.

Every retry, split and failure is counted (`counters()`) and logged (a retry or split line at most once per
server every 30 s, the next saying how many were left out). The client is thread-safe.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from pydantic import TypeAdapter, ValidationError

from stagectl.config.plan import ServerList
from stagectl.console import QuietRepeats
from stagectl.inference.requests import (
    contiguous_parts,
    detection_request,
    read_answer_item,
    request_config,
    to_generation,
    with_seed_offset,
)
from stagectl.wire.deadline import CallDeadlineError, DeadlineClient, within
from stagectl.wire.errors import (
    ClientClosedError,
    RolloutRequestError,
    RolloutRequestFailedError,
    RolloutServerError,
    WrongVersionError,
)
from stagectl.wire.http import raise_for_status, response_detail, server_version
from stagectl.wire.protocol import (
    InferBody,
    InferRequest,
    InferResponse,
    RequestConfig,
    VersionResponse,
    read_token,
)
from stagectl.wire.tls import client_context

__all__ = [  # the request helpers are re-exported: callers need one import for the whole client side
    "ClientClosedError",
    "RolloutClient",
    "RolloutRequestError",
    "RolloutRequestFailedError",
    "RolloutServerError",
    "WrongVersionError",
    "contiguous_parts",
    "detection_request",
    "request_config",
    "to_generation",
]

log = logging.getLogger("stagectl.rollout.client")  # the name from before the move: log filters keep working
_ITEMS = TypeAdapter(list[Any])  # each item read by `read_answer_item` (either swift shape)


class _Retryable(Exception):
    """Internal: a failure worth a retry (connection trouble, timeout, 5xx). `gone`: the server is not
    there (no connection, or the connection dropped), not just slow or failing. `status`: the HTTP status
    the server answered with (None: no answer)."""

    def __init__(self, message: str, *, gone: bool = False, status: int | None = None) -> None:
        super().__init__(message)
        self.gone = gone
        self.status = status


class _ServerGone(Exception):
    """Internal: a server failed a call and its retry as gone; its share goes to another server."""


# the transport errors of a server that is not there (a slow one times out on the read: not gone)
_GONE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class RolloutClient:
    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        timeout_s: float = 120.0,
        infer_timeout_s: float | None = 600.0,
        auth_token: str | None = None,
        connect_timeout_s: float = 10.0,
        tls_ca_file: Path | None = None,
        tls_skip_verify: bool = False,
        infer_timeout_key: str = "infer_timeout_s",
    ) -> None:
        """`infer_timeout_key`: the config key of `infer_timeout_s`, named when a call times out."""
        if not base_urls:
            raise ValueError("RolloutClient needs at least one server base URL")
        self.base_urls = [url.rstrip("/") for url in base_urls]
        self._tls: ssl.SSLContext | None = None  # for https:// servers
        if any(url.startswith("https://") for url in self.base_urls):
            self._tls = client_context(tls_ca_file, skip_verify=tls_skip_verify)
        self.timeout_s = timeout_s
        read_timeout = infer_timeout_s if infer_timeout_s is not None and infer_timeout_s > 0 else None
        self._timeout = httpx.Timeout(connect_timeout_s, read=read_timeout, write=read_timeout, pool=None)
        self._total_s = read_timeout  # every call whole within it (a trickled answer too); None: no limit
        self._infer_timeout_key = infer_timeout_key
        self._headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._clients = [self._new_http() for _ in self.base_urls]
        self._fresh: set[DeadlineClient] = (
            set()
        )  # the retries' own clients while they run (`close` aborts them)
        self.active: list[int] = list(
            range(len(self.base_urls))
        )  # the servers requests go to (`use_servers`)
        self._pool = ThreadPoolExecutor(max_workers=len(self.base_urls), thread_name_prefix="rollout-client")
        self._lock = threading.Lock()
        self._counts = {"infer_calls": 0, "retries": 0, "splits": 0, "failed_calls": 0, "failovers": 0}
        self._closed = threading.Event()  # set by `close`: a call it cut off is not retried
        self._repeats = QuietRepeats()  # a server down: one retry line per server every 30 s, not per chunk

    @classmethod
    def for_servers(cls, servers: ServerList) -> RolloutClient:
        """A client of `servers` (the token read from the variable `servers.auth_token_env` names; a
        missing one is reported under `servers.token_key`)."""
        return cls(
            servers.base_urls,
            timeout_s=servers.wait_healthy_s,
            infer_timeout_s=servers.infer_timeout_s,
            auth_token=read_token(servers.auth_token_env, servers.token_key),
            tls_ca_file=servers.tls_ca_file,
            tls_skip_verify=servers.tls_skip_verify,
            infer_timeout_key=f"{servers.key}.infer_timeout_s",
        )

    def _new_http(self) -> DeadlineClient:
        return DeadlineClient(
            total_s=self._total_s, timeout=self._timeout, headers=self._headers, verify=self._tls or True
        )

    # --- counters --------------------------------------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def counters(self) -> dict[str, int]:
        """Cumulative counts for metrics: infer_calls (HTTP calls), retries, splits, failed_calls,
        failovers (a gone server's share re-sent to another server)."""
        with self._lock:
            return dict(self._counts)

    # --- health and metadata ---------------------------------------------------------------------

    def wait_healthy(
        self,
        timeout_s: float | None = None,
        on_wait: Callable[[str], None] | None = None,
        wait_key: str | None = None,
    ) -> None:
        """Block until every server answers `/health/` with 200; `TimeoutError` names those that did not.
        `on_wait(line)` is called once when the first round of probes finds a server not ready: the line
        says which, why and how long the wait may take (the caller prints it: a wait of minutes is never
        silent). `wait_key`: the config key that sets the wait, named in that line."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        pending = set(range(len(self.base_urls)))
        last_error: dict[int, str] = {}
        told = on_wait is None
        while pending:
            for k in sorted(pending):
                try:
                    with within(min(5.0, max(deadline - time.monotonic(), 0.5))):  # each probe whole
                        response = self._clients[k].get(f"{self.base_urls[k]}/health/", timeout=5.0)
                except httpx.HTTPError as exc:
                    last_error[k] = f"{type(exc).__name__}: {exc}"
                    continue
                if response.status_code == 200:
                    pending.discard(k)
                else:
                    last_error[k] = f"HTTP {response.status_code}"
            if not pending:
                return
            down = ", ".join(
                f"{self.base_urls[k]} ({last_error.get(k, 'no answer')})" for k in sorted(pending)
            )
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout servers not healthy after {limit:g} s: {down}")
            if not told and on_wait is not None:
                told = True
                by = f" ({wait_key})" if wait_key else ""
                on_wait(f"waiting up to {limit:g} s{by} for /health/ of {down}")
            time.sleep(0.25)

    def use_servers(self, indices: Sequence[int]) -> None:
        """Send rollout requests to these servers only (a down or not yet re-synced one takes none; the
        others carry its share). An empty list keeps the last servers: their calls fail until one is back."""
        if indices:
            with self._lock:
                self.active = sorted(indices)

    def _mark_down(self, k: int) -> list[int]:
        """Server `k` is gone: it takes no more requests (until `use_servers` names it again). The
        servers left to take its share; the last server is kept in `active` (its calls fail until one
        is back), but none is left to take its share."""
        with self._lock:
            others = [i for i in self.active if i != k]
            if others:
                self.active = others
            return others

    def versions(self) -> list[VersionResponse]:
        """Every server's weight version: what Channel-B training starts from. A server without
        `/version/` (a `swift rollout` or `swift deploy` server) is refused here, at start-up."""
        return [server_version(http, url) for http, url in zip(self._clients, self.base_urls, strict=True)]

    def world_size(self) -> int:
        return sum(int(self._get(k, "/get_world_size/")["world_size"]) for k in range(len(self.base_urls)))

    def stats(self) -> list[dict[str, Any]]:
        return [self._get(k, "/stats/") for k in range(len(self.base_urls))]

    def _get(self, k: int, path: str) -> Any:
        response = self._clients[k].get(f"{self.base_urls[k]}{path}")
        raise_for_status(response, self.base_urls[k], path)
        return response.json()

    # --- inference -------------------------------------------------------------------------------

    def infer(
        self, requests: Sequence[InferRequest], config: RequestConfig, *, weight_version: int | None = None
    ) -> list[InferResponse]:
        """One response per request, in order (request i sampled with `config.seed + i`). `weight_version`:
        every server must answer with exactly that version (`WrongVersionError` otherwise; stagectl's
        servers only, `VersionResponse.version_tags`)."""
        if not requests:
            return []
        with self._lock:
            active = list(self.active)
        parts = contiguous_parts(len(requests), len(active))
        if len(parts) == 1:
            return self._infer_share(active[0], list(requests), config, 0, weight_version)
        futures = [
            self._pool.submit(self._infer_share, k, list(requests[start:stop]), config, start, weight_version)
            for k, (start, stop) in zip(active, parts, strict=False)
        ]
        out: list[InferResponse] = []
        for future in futures:
            out += future.result()
        return out

    def _infer_share(
        self,
        k: int,
        requests: list[InferRequest],
        config: RequestConfig,
        offset: int,
        weight_version: int | None,
    ) -> list[InferResponse]:
        """One server's share of a call; if that server is gone, the whole share again on another
        active server (same seeds, same `weight_version`), until none is left."""
        tried = {k}
        while True:
            try:
                return self._infer_chunk(k, requests, config, offset, weight_version)
            except _ServerGone as gone:
                others = [i for i in self._mark_down(k) if i not in tried]
                if not others:
                    self._count("failed_calls")
                    raise RolloutServerError(f"{gone}; no other rollout server to take its share") from None
                k = others[0]
                tried.add(k)
                self._count("failovers")
                log.warning(
                    "%s; rollout server marked down, its share re-sent to %s", gone, self.base_urls[k]
                )

    def _infer_chunk(
        self,
        k: int,
        requests: list[InferRequest],
        config: RequestConfig,
        offset: int,
        weight_version: int | None = None,
    ) -> list[InferResponse]:
        body = InferBody(
            infer_requests=requests,
            request_config=with_seed_offset(config, offset),
            weight_version=weight_version,
        )
        where = f"{self.base_urls[k]} requests [{offset}, {offset + len(requests)}) seed={body.request_config.seed}"
        try:
            return self._post_infer(k, body, fresh=False)
        except _Retryable as first:
            if self._closed.is_set():  # `close` cut this call off: the owner is stopping, nothing to retry
                raise ClientClosedError(f"rollout {where}: the client was closed ({first})") from None
            self._count("retries")
            self._repeats.warn(
                log, (k, "retry"), f"rollout {where} failed ({first}); retrying on a fresh connection"
            )
        try:
            return self._post_infer(k, body, fresh=True)
        except _Retryable as second:
            if self._closed.is_set():
                raise ClientClosedError(f"rollout {where}: the client was closed ({second})") from None
            if second.gone:
                raise _ServerGone(f"rollout {where}: server gone ({second})") from None
            if len(requests) == 1:
                self._count("failed_calls")
                # a server error answered to this one request (not a 503 of a stopping or busy server)
                failed = RolloutRequestFailedError if second.status == 500 else RolloutServerError
                raise failed(f"rollout {where} failed twice: {second}") from None
            self._count("splits")
            self._repeats.warn(
                log, (k, "split"), f"rollout {where} failed again ({second}); splitting it in halves"
            )
        mid = len(requests) // 2
        return self._infer_chunk(k, requests[:mid], config, offset, weight_version) + self._infer_chunk(
            k, requests[mid:], config, offset + mid, weight_version
        )

    def _post_infer(self, k: int, body: InferBody, *, fresh: bool) -> list[InferResponse]:
        url = f"{self.base_urls[k]}/infer/"
        payload = body.model_dump(mode="json", exclude_none=True)  # swift reads `{"type": "image"}` items
        self._count("infer_calls")
        try:
            if fresh:
                http = self._new_http()
                with self._lock:  # `close` sets `_closed`, then aborts those registered: this one, or none
                    if not (closed := self._closed.is_set()):
                        self._fresh.add(http)
                if closed:
                    http.close()
                    raise _Retryable("the client was closed")
                try:
                    with http:
                        response = http.post(url, json=payload)
                finally:
                    with self._lock:
                        self._fresh.discard(http)
            else:
                response = self._clients[k].post(url, json=payload)
        except httpx.TimeoutException as exc:
            raise _Retryable(self._timed_out(exc)) from exc
        except httpx.HTTPError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}", gone=isinstance(exc, _GONE)) from exc
        if response.status_code >= 500 or response.status_code in (408, 429):
            raise _Retryable(
                f"HTTP {response.status_code}: {response_detail(response)}", status=response.status_code
            )
        if response.status_code == 409 and body.weight_version is not None:
            raise WrongVersionError(f"{url}: HTTP 409: {response_detail(response)}")
        raise_for_status(response, self.base_urls[k], "/infer/")
        try:
            results = [read_answer_item(item) for item in _ITEMS.validate_json(response.content)]
        except (ValidationError, ValueError) as exc:
            raise RolloutServerError(f"{url} answered with an unexpected body: {exc}") from None
        if len(results) != len(body.infer_requests):
            raise RolloutServerError(
                f"{url} answered {len(results)} items for {len(body.infer_requests)} requests"
            )
        return results

    def _timed_out(self, exc: httpx.TimeoutException) -> str:
        """What timed out, after how long, and the key that sets it (httpx says only "timed out")."""
        name = type(exc).__name__
        if isinstance(exc, CallDeadlineError):
            return f"{name}: {exc} ({self._infer_timeout_key} sets it)"
        if isinstance(exc, httpx.ConnectTimeout):
            return f"{name}: no connection within {self._timeout.connect} s"
        return f"{name}: no answer within {self._timeout.read} s ({self._infer_timeout_key} sets it)"

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            in_flight = [*self._clients, *self._fresh]
        for http in in_flight:  # a call still waiting on a server ends now: closing does not wait it out
            http.abort()
        self._pool.shutdown(wait=True)
        for http in self._clients:
            http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
