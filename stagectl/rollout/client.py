"""`RolloutClient`: the learner's side of the rollout-server protocol (httpx).

- `wait_healthy()` polls `/health/` on every server until `timeout_s`.
- `infer(requests, config)` spreads the requests over the servers in contiguous chunks (in parallel)
  and reassembles the responses in order. A failed call (connection error, timeout, 5xx) is retried
  once on a fresh connection, then the chunk is split in halves recursively down to single requests.
  Each piece is sent with `seed + offset`, so every request keeps seed `config.seed + its index`
  however the chunk was cut (see `protocol.py`). 4xx answers are the caller's mistake: raised at once.
- `push_weights(state_dict, version)` (rank 0) runs a sync on every server: `http` streams
  safetensors chunks (zero-copy views of the tensors, XXH3-128 per chunk) and commits only after every
  server staged every chunk, sending only the changed elements when delta sync is on; `shm` writes one
  snapshot to /dev/shm that every server on this node maps; `disk` writes one snapshot that each server
  loads by path. A failure aborts the sync everywhere and raises.

The token (when given) goes on every request but `/health/`. `https://` servers are verified against
the system's trust store or `tls_ca_file`, and only left unverified with `tls_skip_verify`.

Every retry, split and failure is counted (`counters()`) and logged. The client is thread-safe: a
prefetcher thread may call `infer` while the main thread pushes weights.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
from pydantic import TypeAdapter, ValidationError

from stagectl.config.rollout import RolloutMatchingConfig
from stagectl.rollout.chunk_sender import ChunkSender
from stagectl.rollout.collective import GroupError, GroupInfo, WeightGroup, host_store
from stagectl.rollout.delta import DeltaTracker
from stagectl.rollout.errors import DeltaRefused, RolloutRequestError, RolloutServerError, WeightPushError
from stagectl.rollout.protocol import (
    WEIGHT_CHUNK_PATH,
    InferBody,
    InferRequest,
    InferResponse,
    RequestConfig,
    SyncResponse,
    VersionResponse,
    read_token,
)
from stagectl.rollout.requests import (
    contiguous_parts,
    detection_request,
    read_answer_item,
    request_config,
    to_generation,
    with_seed_offset,
)
from stagectl.rollout.shm import SHM_DIR, remove_stale, shm_path, write_snapshot
from stagectl.rollout.tls import client_context
from stagectl.rollout.weights import (
    TensorStream,
    WeightChunk,
    WeightState,
    encode_chunks,
    encode_pieces,
    spec_num_bytes,
    spec_of,
)

__all__ = [  # the request helpers are re-exported: callers need one import for the whole client side
    "PushReport",
    "RolloutClient",
    "RolloutRequestError",
    "RolloutServerError",
    "WeightPushError",
    "contiguous_parts",
    "detection_request",
    "request_config",
    "to_generation",
]

log = logging.getLogger("stagectl.rollout.client")
Transport = Literal["http", "disk", "shm", "collective"]
T = TypeVar("T")
_ITEMS = TypeAdapter(list[Any])  # each item read by `read_answer_item` (either swift shape)
MIB = 1024 * 1024


class _Retryable(Exception):
    """Internal: a failure worth a retry (connection trouble, timeout, 5xx)."""


@dataclass(frozen=True)
class PushReport:
    version: int
    transport: Transport
    num_bytes: int  # bytes sent (a delta: the changed blocks only)
    num_chunks: int
    seconds: float
    state_bytes: int = 0  # tensor bytes of the whole state dict
    delta: bool = False  # True when only changed blocks went out


def _state_bytes(state: WeightState) -> int:
    if isinstance(state, TensorStream):
        return state.num_bytes
    return sum(t.numel() * t.element_size() for t in state.values())


class RolloutClient:
    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        timeout_s: float = 120.0,
        infer_timeout_s: float | None = 600.0,
        auth_token: str | None = None,
        transport: Transport = "http",
        chunk_bytes: int = 64 * MIB,
        disk_dir: str | Path | None = None,
        connect_timeout_s: float = 10.0,
        delta: bool = False,
        shm_dir: Path = SHM_DIR,
        group_address: str = "127.0.0.1",
        tls_ca_file: Path | None = None,
        tls_skip_verify: bool = False,
    ) -> None:
        if not base_urls:
            raise ValueError("RolloutClient needs at least one server base URL")
        self.base_urls = [url.rstrip("/") for url in base_urls]
        self._tls: ssl.SSLContext | None = None  # for https:// servers (and their weight-stream ports)
        if any(url.startswith("https://") for url in self.base_urls):
            self._tls = client_context(tls_ca_file, skip_verify=tls_skip_verify)
        self.timeout_s = timeout_s
        read_timeout = infer_timeout_s if infer_timeout_s is not None and infer_timeout_s > 0 else None
        self._timeout = httpx.Timeout(connect_timeout_s, read=read_timeout, write=read_timeout, pool=None)
        self._headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self.transport: Transport = transport
        self.chunk_bytes = chunk_bytes
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.shm_dir = shm_dir
        if transport == "shm":
            if not shm_dir.is_dir():
                raise ValueError(
                    f"weight sync transport shm needs {shm_dir} (a tmpfs); use http or disk here"
                )
            remove_stale(shm_dir)  # snapshots of learners killed before they could clean up
        self._delta = DeltaTracker() if delta else None
        self.group_address = group_address
        self._group: WeightGroup | None = None  # transport collective: joined at the first push
        self._clients = [self._new_http() for _ in self.base_urls]
        # Enough threads for an `infer` (one per server) and a `push_weights` (one per server + read-ahead) at once.
        self._pool = ThreadPoolExecutor(
            max_workers=2 * len(self.base_urls), thread_name_prefix="rollout-client"
        )
        self._lock = threading.Lock()
        self._counts = {"infer_calls": 0, "retries": 0, "splits": 0, "failed_calls": 0, "weight_pushes": 0}
        self._counts["delta_fallbacks"] = 0
        self.last_push: PushReport | None = None

    @classmethod
    def from_config(
        cls,
        rm: RolloutMatchingConfig,
        *,
        base_urls: Sequence[str] | None = None,
        disk_dir: str | Path | None = None,
    ) -> RolloutClient:
        """From `custom.extra.rollout_matching`; `base_urls` overrides `vllm.server.servers` (an embedded
        server's address), `disk_dir` is the default of `vllm.sync.disk_dir` (`{output_dir}/weight_sync`)."""
        server, sync = rm.vllm.server, rm.vllm.sync  # validated: sync.mode is full
        urls = list(base_urls) if base_urls is not None else [s.base_url for s in server.servers]
        token = read_token(server.auth_token_env, "custom.extra.rollout_matching.vllm.server.auth_token_env")
        return cls(
            urls,
            timeout_s=server.timeout_s,
            infer_timeout_s=server.infer_timeout_s,
            auth_token=token,
            transport=_transport(sync.transport),
            chunk_bytes=int(sync.chunk_mb * MIB),
            disk_dir=sync.disk_dir if sync.disk_dir is not None else disk_dir,
            delta=sync.delta,
            group_address=sync.group_address,
            tls_ca_file=server.tls_ca_file,
            tls_skip_verify=server.tls_skip_verify,
        )

    def _new_http(self) -> httpx.Client:
        return httpx.Client(timeout=self._timeout, headers=self._headers, verify=self._tls or True)

    # --- counters --------------------------------------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def counters(self) -> dict[str, int]:
        """Cumulative counts for metrics: infer_calls (HTTP calls), retries, splits, failed_calls, weight_pushes."""
        with self._lock:
            return dict(self._counts)

    # --- health and metadata ---------------------------------------------------------------------

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Block until every server answers `/health/` with 200; `TimeoutError` names those that did not."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        pending = set(range(len(self.base_urls)))
        last_error: dict[int, str] = {}
        while pending:
            for k in sorted(pending):
                try:
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
            if time.monotonic() > deadline:
                down = ", ".join(
                    f"{self.base_urls[k]} ({last_error.get(k, 'no answer')})" for k in sorted(pending)
                )
                raise TimeoutError(
                    f"rollout servers not healthy after {timeout_s or self.timeout_s:g} s: {down}"
                )
            time.sleep(0.25)

    def versions(self) -> list[VersionResponse]:
        """Every server's weight version: what Channel-B training starts from. A server without
        `/version/` (a `swift rollout` or `swift deploy` server) is refused here, at start-up."""
        return [self._version(k) for k in range(len(self.base_urls))]

    def _version(self, k: int) -> VersionResponse:
        response = self._clients[k].get(f"{self.base_urls[k]}/version/")
        if response.status_code == 404:
            raise RolloutRequestError(
                f"{self.base_urls[k]} has no /version/: it is not a stagectl rollout server (a `swift rollout` "
                "server?). Channel-B training needs the weight version of every rollout and stagectl's weight "
                "sync, which a swift server gives neither of; serve with `stagectl rollout-server`. A swift "
                "server can serve inference only (Stage-B, eval): see docs/swift_interop.md"
            )
        _raise_for_status(response, self.base_urls[k], "/version/")
        return VersionResponse.model_validate(response.json())

    def world_size(self) -> int:
        return sum(int(self._get(k, "/get_world_size/")["world_size"]) for k in range(len(self.base_urls)))

    def stats(self) -> list[dict[str, Any]]:
        return [self._get(k, "/stats/") for k in range(len(self.base_urls))]

    def _get(self, k: int, path: str) -> Any:
        response = self._clients[k].get(f"{self.base_urls[k]}{path}")
        _raise_for_status(response, self.base_urls[k], path)
        return response.json()

    # --- inference -------------------------------------------------------------------------------

    def infer(self, requests: Sequence[InferRequest], config: RequestConfig) -> list[InferResponse]:
        """One response per request, in order (request i sampled with `config.seed + i`)."""
        if not requests:
            return []
        parts = contiguous_parts(len(requests), len(self.base_urls))
        if len(parts) == 1:
            return self._infer_chunk(0, list(requests), config, 0)
        futures = [
            self._pool.submit(self._infer_chunk, k, list(requests[start:stop]), config, start)
            for k, (start, stop) in enumerate(parts)
        ]
        out: list[InferResponse] = []
        for future in futures:
            out += future.result()
        return out

    def _infer_chunk(
        self, k: int, requests: list[InferRequest], config: RequestConfig, offset: int
    ) -> list[InferResponse]:
        body = InferBody(infer_requests=requests, request_config=with_seed_offset(config, offset))
        where = f"{self.base_urls[k]} requests [{offset}, {offset + len(requests)}) seed={body.request_config.seed}"
        try:
            return self._post_infer(k, body, fresh=False)
        except _Retryable as first:
            self._count("retries")
            log.warning("rollout %s failed (%s); retrying on a fresh connection", where, first)
        try:
            return self._post_infer(k, body, fresh=True)
        except _Retryable as second:
            if len(requests) == 1:
                self._count("failed_calls")
                raise RolloutServerError(f"rollout {where} failed twice: {second}") from None
            self._count("splits")
            log.warning("rollout %s failed again (%s); splitting it in halves", where, second)
        mid = len(requests) // 2
        return self._infer_chunk(k, requests[:mid], config, offset) + self._infer_chunk(
            k, requests[mid:], config, offset + mid
        )

    def _post_infer(self, k: int, body: InferBody, *, fresh: bool) -> list[InferResponse]:
        url = f"{self.base_urls[k]}/infer/"
        payload = body.model_dump(mode="json", exclude_none=True)  # swift reads `{"type": "image"}` items
        self._count("infer_calls")
        try:
            if fresh:
                with self._new_http() as http:
                    response = http.post(url, json=payload)
            else:
                response = self._clients[k].post(url, json=payload)
        except httpx.HTTPError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500 or response.status_code in (408, 429):
            raise _Retryable(f"HTTP {response.status_code}: {_detail(response)}")
        _raise_for_status(response, self.base_urls[k], "/infer/")
        try:
            results = [read_answer_item(item) for item in _ITEMS.validate_json(response.content)]
        except (ValidationError, ValueError) as exc:
            raise RolloutServerError(f"{url} answered with an unexpected body: {exc}") from None
        if len(results) != len(body.infer_requests):
            raise RolloutServerError(
                f"{url} answered {len(results)} items for {len(body.infer_requests)} requests"
            )
        return results

    # --- weights ---------------------------------------------------------------------------------

    def push_weights(
        self,
        state_dict: WeightState,
        version: int,
        transport: Transport | None = None,
        *,
        base_version: int | None = None,
    ) -> PushReport:
        """Sync `state_dict` (every tensor the servers' models have, same names/shapes/dtypes) to every
        server as `version`; raises `WeightPushError` (old weights keep serving) on failure.

        A `TensorStream` (the learner's FSDP shards gathered a tensor at a time) is sent as it arrives by
        every transport, holding a chunk (http) or a tensor (collective, shm, disk) at a time. The one
        exception is a delta sync, which compares whole tensors against its host copy of the last push:
        it collects the stream into a dict first. A push that fails part-way leaves the rest of the
        stream untaken; the caller drains it (its tensors may be collectives other ranks wait in).

        With delta sync on (http only) and `base_version` equal to the version of this client's last
        successful push, only the changed elements are sent (see `rollout.delta`); a server that refuses the
        base gets a full sync instead (counted in `delta_fallbacks`)."""
        chosen = transport or self.transport
        start = time.perf_counter()
        tracked = self.keeps_delta_base(chosen)
        if tracked and isinstance(state_dict, TensorStream):
            state_dict = dict(state_dict.checked())
        plan = None
        try:
            if chosen == "http":
                sent = None
                if tracked and base_version is not None and self._delta_base() == base_version:
                    assert self._delta is not None and not isinstance(state_dict, TensorStream)
                    plan = self._delta.plan(state_dict, self.chunk_bytes)
                    try:
                        sent = self._push_http(
                            encode_pieces(plan.pieces, self.chunk_bytes), version, base_version
                        )
                    except DeltaRefused as exc:
                        plan = None
                        self._count("delta_fallbacks")
                        log.warning("delta sync refused (%s); sending a full sync", exc)
                if sent is None:
                    sent = self._push_http(encode_chunks(state_dict, self.chunk_bytes), version, None)
                num_bytes, num_chunks = sent
            elif chosen == "shm":
                num_bytes, num_chunks = self._push_shm(state_dict, version), 1
            elif chosen == "collective":
                num_bytes, num_chunks = self._push_collective(state_dict, version), 1
            else:
                num_bytes, num_chunks = self._push_disk(state_dict, version), 1
        except WeightPushError:
            if self._delta is not None:
                self._delta.reset()
            raise
        if self._delta is not None:
            if tracked:
                assert not isinstance(state_dict, TensorStream)
                self._delta.pushed(version, state_dict, plan)
            else:
                self._delta.reset()
        state_bytes = plan.total_bytes if plan is not None else _state_bytes(state_dict)
        delta = plan is not None
        report = PushReport(
            version,
            chosen,
            num_bytes,
            num_chunks,
            time.perf_counter() - start,
            state_bytes=state_bytes,
            delta=delta,
        )
        self._count("weight_pushes")
        self.last_push = report
        log.info(
            "weights version %d pushed over %s%s: %.1f MB of %.1f MB in %.2f s",
            version,
            chosen,
            " (delta)" if delta else "",
            num_bytes / 1e6,
            state_bytes / 1e6,
            report.seconds,
        )
        return report

    def keeps_delta_base(self, transport: Transport | None = None) -> bool:
        """True when a push over `transport` (default: the configured one) keeps a host copy of the whole
        state dict for delta sync."""
        return self._delta is not None and (transport or self.transport) == "http"

    def _delta_base(self) -> int | None:
        return self._delta.ver if self._delta is not None else None

    def _push_http(
        self, chunks: Iterator[WeightChunk], version: int, base_version: int | None
    ) -> tuple[int, int]:
        """Stream `chunks` to every server and commit. Pipeline: the next chunk's header and digest are
        prepared on a pool thread while the current one is on the wire, and each server checks, hashes
        and stages a chunk as its bytes arrive. The bytes go from the tensors' memory to the socket (one
        copy in the HTTP stack). Returns (bytes sent, chunks)."""
        sync_id = uuid.uuid4().hex
        num_bytes = num_chunks = 0
        sender = ChunkSender(self._headers, self._timeout.read, self._tls)
        try:
            chunk_urls = self._on_every_server(self._chunk_url)
            upcoming = self._pool.submit(next, chunks, None)
            while (chunk := upcoming.result()) is not None:
                upcoming = self._pool.submit(next, chunks, None)
                params: dict[str, Any] = {
                    "sync_id": sync_id,
                    "chunk_index": chunk.index,
                    "digest": chunk.digest,
                    "version": version,
                }
                if base_version is not None:
                    params["base_version"] = base_version
                self._on_every_server(
                    partial(self._post_chunk, urls=chunk_urls, params=params, chunk=chunk, sender=sender)
                )
                num_bytes += chunk.num_bytes
                num_chunks += 1
            commit = {"sync_id": sync_id, "version": version, "num_chunks": num_chunks}
            responses = self._on_every_server(lambda k: self._post(k, "/update_weights/commit/", json=commit))
        except WeightPushError:
            self._on_every_server(lambda k: self._abort(k, sync_id))
            raise
        finally:
            sender.close()
        _check_versions(responses, version)
        return num_bytes, num_chunks

    def _push_shm(self, state_dict: WeightState, version: int) -> int:
        """One snapshot in shared memory, mapped by every server (all on this node); removed here whatever
        happens (a SIGKILL leaves it to the next start's `remove_stale`)."""
        path = shm_path(uuid.uuid4().hex, self.shm_dir)
        try:
            digest, num_bytes = write_snapshot(path, state_dict)
            body = {"path": str(path), "version": version, "digest": digest}
            responses = self._on_every_server(lambda k: self._post(k, "/update_weights/from_shm/", json=body))
            _check_versions(responses, version)
        finally:
            path.unlink(missing_ok=True)
        return num_bytes

    def _push_collective(self, state_dict: WeightState, version: int) -> int:
        """Announce the tensors to every server (each checks them and starts receiving), broadcast them in
        that order through the weight group, then let every server apply them. After any failure the
        group is dropped on both sides and the next push forms a new one."""
        if isinstance(state_dict, TensorStream):
            specs, tensors = state_dict.specs, state_dict.checked()
        else:
            whole = {name: t.detach().contiguous().cpu() for name, t in state_dict.items()}
            specs, tensors = {name: spec_of(t) for name, t in whole.items()}, iter(whole.items())
        sync_id = uuid.uuid4().hex
        announce = {
            "sync_id": sync_id,
            "version": version,
            "tensors": [
                {"name": name, "dtype": spec.dtype, "shape": list(spec.shape)} for name, spec in specs.items()
            ],
        }
        try:
            group = self._start_collective(announce)
            for _, tensor in tensors:
                group.broadcast(tensor)
                del tensor  # a stream's tensor is the only copy: let it go before the next arrives
            finish = {"sync_id": sync_id, "version": version}
            responses = self._on_every_server(
                lambda k: self._post(k, "/update_weights/group/finish/", json=finish)
            )
        except (WeightPushError, GroupError) as exc:
            self._group = None
            self._on_every_server(lambda k: self._abort(k, sync_id))
            if isinstance(exc, GroupError):  # a member died mid-broadcast: like a lost connection
                raise WeightPushError(str(exc), unreachable=True) from None
            raise
        _check_versions(responses, version)
        return sum(spec_num_bytes(spec) for spec in specs.values())

    def _start_collective(self, announce: dict[str, Any]) -> WeightGroup:
        """Every server checks the announced tensors and starts receiving; a server outside the group
        (restarted: 409) makes this client form the group again, once."""
        for attempt in range(2):
            if self._group is None:
                self._group = self._join_group()
            try:
                self._on_every_server(lambda k: self._post(k, "/update_weights/group/start/", json=announce))
                return self._group
            except DeltaRefused as exc:  # 409: not in the group
                if attempt:
                    raise WeightPushError(str(exc)) from None
                log.warning("weight group gone on a server (%s); forming it again", exc)
                self._group = None
                self._on_every_server(lambda k: self._abort(k, announce["sync_id"]))
        raise AssertionError("unreachable")

    def _join_group(self) -> WeightGroup:
        """Host the weight group's store, ask every server to join (ranks 1..n) and join as rank 0; an
        error from any server ends the wait at once."""
        world_size = len(self.base_urls) + 1
        try:
            store = host_store(self.group_address, world_size, self.timeout_s)
        except GroupError as exc:
            raise WeightPushError(str(exc)) from None
        infos = [
            GroupInfo(self.group_address, store.port, rank, world_size, self.timeout_s)
            for rank in range(world_size)
        ]
        joining = [
            self._pool.submit(self._post, k, "/update_weights/group/init/", json=asdict(infos[k + 1]))
            for k in range(len(self.base_urls))
        ]
        own = self._pool.submit(WeightGroup, infos[0], store)
        for future in as_completed([own, *joining]):
            error = future.exception()
            if isinstance(error, GroupError):
                raise WeightPushError(str(error), unreachable=True) from None
            if error is not None:
                raise error
        group = own.result()
        log.info(
            "weight group formed at %s:%d with %d servers", self.group_address, store.port, world_size - 1
        )
        return group

    def _push_disk(self, state_dict: WeightState, version: int) -> int:
        if self.disk_dir is None:
            raise ValueError("disk weight sync needs custom.extra.rollout_matching.vllm.sync.disk_dir")
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        path = (self.disk_dir / f"weights_v{version}.safetensors").absolute()
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)  # a crashed push's leftover
        _, num_bytes = write_snapshot(tmp, state_dict)
        os.replace(tmp, path)  # servers never see a half-written snapshot
        try:
            body = {"path": str(path), "version": version}
            responses = self._on_every_server(
                lambda k: self._post(k, "/update_weights/from_disk/", json=body)
            )
            _check_versions(responses, version)
        finally:
            path.unlink(missing_ok=True)
        return num_bytes

    def _on_every_server(self, call: Callable[[int], T]) -> list[T]:
        futures = [self._pool.submit(call, k) for k in range(len(self.base_urls))]
        return [future.result() for future in futures]

    def _chunk_url(self, k: int) -> tuple[str, bool]:
        """Where server `k` takes weight chunks: its weight-stream port when it advertises one (asked at
        every sync: a restarted server has a new one), else its app port; and whether it is the former."""
        try:
            port = VersionResponse.model_validate(self._get(k, "/version/")).weight_stream_port
        except (httpx.HTTPError, ValueError) as exc:  # incl. a 4xx (RolloutRequestError) or a bad body
            raise WeightPushError(f"{self.base_urls[k]}/version/: {exc}") from exc
        if port is None:
            return f"{self.base_urls[k]}{WEIGHT_CHUNK_PATH}", False
        return str(httpx.URL(self.base_urls[k]).copy_with(port=port).join(WEIGHT_CHUNK_PATH)), True

    def _post(self, k: int, path: str, **kwargs: Any) -> Any:
        return self._post_url(f"{self.base_urls[k]}{path}", k, **kwargs)

    def _post_url(self, url: str, k: int, **kwargs: Any) -> Any:
        try:
            response = self._clients[k].post(url, **kwargs)
        except httpx.HTTPError as exc:
            raise WeightPushError(f"{url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 409:
            raise DeltaRefused(f"{url}: HTTP 409: {_detail(response)}")
        if response.status_code != 200:
            raise WeightPushError(f"{url}: HTTP {response.status_code}: {_detail(response)}")
        return response.json()

    def _post_chunk(
        self,
        k: int,
        *,
        urls: Sequence[tuple[str, bool]],
        params: dict[str, Any],
        chunk: WeightChunk,
        sender: ChunkSender,
    ) -> Any:
        url, streamed = urls[k]
        if streamed:
            return sender.post(k, url, params, chunk)
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(chunk.num_bytes)}
        return self._post_url(url, k, params=params, content=chunk.parts(), headers=headers)

    def _abort(self, k: int, sync_id: str) -> None:
        try:
            self._clients[k].post(f"{self.base_urls[k]}/update_weights/abort/", json={"sync_id": sync_id})
        except httpx.HTTPError as exc:  # the server discards a stale staging on the next sync anyway
            log.warning("could not abort weight sync %s on %s: %s", sync_id, self.base_urls[k], exc)

    def close(self) -> None:
        self._group = None  # its store and gloo threads go with it
        self._pool.shutdown(wait=True)
        for http in self._clients:
            http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _transport(name: str) -> Transport:
    if name not in ("http", "disk", "shm", "collective"):
        raise ValueError(f"weight sync transport {name!r} is not built (config validation refuses it)")
    return name  # type: ignore[return-value]


def _check_versions(responses: Sequence[Any], version: int) -> None:
    for response in responses:
        reported = SyncResponse.model_validate(response).version
        if reported != version:
            raise WeightPushError(f"a server reports version {reported} after a sync to {version}")


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    return str(body.get("detail", body)) if isinstance(body, dict) else str(body)[:500]


def _raise_for_status(response: httpx.Response, base_url: str, path: str) -> None:
    if response.status_code >= 400:
        raise RolloutRequestError(f"{base_url}{path}: HTTP {response.status_code}: {_detail(response)}")
