"""Transport `collective`: `CollectiveSender` (the learner), `GroupReceiver` (the server: `group_init`,
`group_start`, `group_finish`, over the shared staging of `weightsync.receiver.WeightSync`) and the weight
group both sides join.

The weight group: the learner (rank 0, the store's host) and every rollout
server (ranks 1..n) in one torch.distributed process group of their own, outside the learner's training
group; a sync is one broadcast per tensor from rank 0, in the order the learner announced.

Backend `gloo` (implemented): TCP, host memory; any engine, the bytes land in the server's host staging as
with `http`. Backend `nccl` is the GPU path (docs/weight_sync.md): the same control flow, but the engine's
workers must join through vLLM's weight-transfer API; it is refused by the config until that is built.
Both sides build the group with the same `GroupInfo` (the learner sends it to each server in
`POST /update_weights/group/init/`), and the group's timeout bounds every collective, so a peer that dies
mid-broadcast ends the others' wait with an error instead of a hang.
"""

from __future__ import annotations

import datetime
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import as_completed
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from stagectl.weightsync.base import Sent, Servers, Transport, check_versions
from stagectl.weightsync.errors import NoGroupError, NotInGroup, WeightPushError, WeightSyncError
from stagectl.weightsync.protocol import SyncResponse
from stagectl.weightsync.receiver import WeightSync
from stagectl.weightsync.wire import TensorStream, WeightState, spec_num_bytes, spec_of

log = logging.getLogger("stagectl.weightsync.collective")


class GroupError(RuntimeError):
    """The weight group could not form, or a collective in it failed or timed out."""


@dataclass(frozen=True)
class GroupInfo:
    master_address: str
    master_port: int
    rank: int
    world_size: int
    timeout_s: float


class WeightGroup:
    """One member of the weight group; `broadcast` from rank 0 into `tensor` (in place on the others)."""

    def __init__(self, info: GroupInfo, store: dist.TCPStore | None = None) -> None:
        """Join (blocks until every member joined or the timeout passed). Rank 0 passes the store it
        hosts (`host_store`), so its port can be sent to the others before they join."""
        timeout = datetime.timedelta(seconds=info.timeout_s)
        self.info = info
        try:
            self._store = store or dist.TCPStore(
                info.master_address, info.master_port, info.world_size, is_master=False, timeout=timeout
            )
            self._group = dist.ProcessGroupGloo(self._store, info.rank, info.world_size, timeout)
        except (RuntimeError, ValueError) as exc:
            raise GroupError(
                f"weight group at {info.master_address}:{info.master_port} (rank {info.rank} of "
                f"{info.world_size}) did not form within {info.timeout_s:g} s: {_first_line(exc)}"
            ) from None

    def broadcast(self, tensor: torch.Tensor) -> None:
        """`tensor` (contiguous) goes out as its bytes, so any dtype travels (gloo has no bool or float8
        kernels); an empty tensor is skipped on every member alike (each knows the shapes)."""
        if tensor.numel() == 0:
            return
        data = tensor.reshape(-1).view(torch.uint8)  # a view: received bytes land in `tensor`
        options = dist.BroadcastOptions()
        options.rootRank = 0
        with _collective(f"broadcast of {tuple(tensor.shape)} {tensor.dtype}", self.info):
            self._group.broadcast([data], options).wait()  # type: ignore[attr-defined]


def host_store(address: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on a free port of `address` (its `.port` goes to the other members)."""
    try:
        return dist.TCPStore(
            address,
            0,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except (RuntimeError, ValueError) as exc:
        raise GroupError(f"cannot host the weight group's store on {address}: {_first_line(exc)}") from None


@contextmanager
def _collective(what: str, info: GroupInfo) -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:
        raise GroupError(
            f"weight group rank {info.rank}: {what} failed (a peer died or it passed {info.timeout_s:g} s): "
            f"{_first_line(exc)}"
        ) from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


class CollectiveSender:
    """Announce the tensors to every server (each checks them and starts receiving), broadcast them in
    that order through the weight group, then let every server apply them. After any failure the group is
    dropped on both sides and the next push forms a new one."""

    transport: Transport = "collective"

    def __init__(self, servers: Servers, group_address: str = "127.0.0.1") -> None:
        self.servers = servers
        self.group_address = group_address
        self._group: WeightGroup | None = None  # joined at the first push

    def keeps_delta_base(self) -> bool:
        return False

    def push(self, state: WeightState, version: int, base_version: int | None) -> Sent:
        servers = self.servers
        if isinstance(state, TensorStream):
            specs, tensors = state.specs, state.checked()
        else:
            whole = {name: t.detach().contiguous().cpu() for name, t in state.items()}
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
            group = self._start(announce)
            for _, tensor in tensors:
                group.broadcast(tensor)
                del tensor  # a stream's tensor is the only copy: let it go before the next arrives
            finish = {"sync_id": sync_id, "version": version}
            responses = servers.on_every(
                lambda k: servers.post(k, "/update_weights/group/finish/", json=finish)
            )
        except (WeightPushError, GroupError) as exc:
            self._group = None
            servers.on_every(lambda k: servers.abort(k, sync_id))
            if isinstance(exc, GroupError):  # a member died mid-broadcast: like a lost connection
                raise WeightPushError(str(exc), unreachable=True) from None
            raise
        check_versions(responses, version)
        num_bytes = sum(spec_num_bytes(spec) for spec in specs.values())
        return Sent(num_bytes, 1, num_bytes)

    def _start(self, announce: dict[str, Any]) -> WeightGroup:
        """Every server checks the announced tensors and starts receiving; a server outside the group
        (restarted: `NotInGroup`, HTTP 412) makes this sender form the group again, once."""
        servers = self.servers
        for attempt in range(2):
            if self._group is None:
                self._group = self._join()
            try:
                servers.on_every(lambda k: servers.post(k, "/update_weights/group/start/", json=announce))
                return self._group
            except NotInGroup as exc:
                if attempt:
                    raise WeightPushError(str(exc)) from None
                log.warning("weight group gone on a server (%s); forming it again", exc)
                self._group = None
                servers.on_every(lambda k: servers.abort(k, announce["sync_id"]))
        raise AssertionError("unreachable")

    def _join(self) -> WeightGroup:
        """Host the weight group's store, ask every server to join (ranks 1..n) and join as rank 0; an
        error from any server ends the wait at once."""
        servers = self.servers
        world_size = len(servers) + 1
        try:
            store = host_store(self.group_address, world_size, servers.timeout_s)
        except GroupError as exc:
            raise WeightPushError(str(exc)) from None
        infos = [
            GroupInfo(self.group_address, store.port, rank, world_size, servers.timeout_s)
            for rank in range(world_size)
        ]
        joining = [
            servers.pool.submit(servers.post, k, "/update_weights/group/init/", json=asdict(infos[k + 1]))
            for k in range(len(servers))
        ]
        own = servers.pool.submit(WeightGroup, infos[0], store)
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

    def close(self) -> None:
        self._group = None  # its store and gloo threads go with it


class GroupReceiver:
    """Transport `collective`, the server's side: join the learner's weight group (`group_init`), check a
    sync's announced tensors and receive their broadcasts into the shared staging (`group_start`), then
    commit (`group_finish`). A failed sync drops the group too (it is left mid-collective); the learner
    re-initialises it."""

    def __init__(self, sync: WeightSync) -> None:
        self.sync = sync
        self._group: WeightGroup | None = None  # the learner's weight group, once joined

    def group_init(self, info: GroupInfo) -> None:
        """Join the learner's weight group, replacing any earlier one (blocks until it formed)."""
        sync = self.sync
        with sync.lock:
            if isinstance(sync.writer, _Receiving):
                sync.fail("a new weight group replaces the one this sync was receiving from")
            self._group = None
        group = WeightGroup(info)  # outside the lock: it waits for the learner and every other server
        with sync.lock:
            self._group = group
        log.info(
            "joined weight group %s:%d as rank %d of %d",
            info.master_address,
            info.master_port,
            info.rank,
            info.world_size,
        )

    def group_start(
        self, sync_id: str, version: int, tensors: Sequence[tuple[str, str, tuple[int, ...]]]
    ) -> None:
        """Check the announced tensors (names, dtypes, shapes, every tensor once) before any byte moves,
        then receive their broadcasts into the staging on a thread of their own; `group_finish` applies."""
        sync = self.sync
        with sync.lock:
            if self._group is None:
                raise NoGroupError(
                    "no weight group on this server (it restarted, or a failed sync dropped it): the learner "
                    "re-initialises it with POST /update_weights/group/init/"
                )
            sync.supersede(sync_id)
            sync.check_above_serving(version)
            staged = sync.start(sync_id, "collective", version, None)
            try:
                destinations = []
                for name, dtype, shape in tensors:
                    staged.reserve(name, None, dtype, tuple(shape))
                    destinations.append(staged.buffers[name])
                staged.check_complete()
            except WeightSyncError as exc:
                sync.fail(str(exc))
                raise WeightSyncError(
                    f"{exc}; sync {sync_id} refused before any byte moved, still serving version {sync.engine.version}"
                ) from None
            receiving = _Receiving(sync_id, self._group, destinations, self._drop_group)
            sync.writer = receiving
        receiving.thread.start()

    def group_finish(self, sync_id: str, version: int) -> SyncResponse:
        """Wait for the broadcasts of `sync_id` to land, then check and apply as a commit does."""
        sync = self.sync
        with sync.lock:
            receiving = sync.writer
            if not isinstance(receiving, _Receiving) or receiving.sync_id != sync_id:
                raise WeightSyncError(
                    f"unknown collective sync {sync_id!r} (never started, aborted or superseded); "
                    f"still serving version {sync.engine.version}"
                )
        receiving.thread.join(receiving.group.info.timeout_s + 5.0)
        with sync.lock:
            if sync.writer is not receiving:
                raise WeightSyncError(
                    f"collective sync {sync_id!r} was aborted while it received; still serving version {sync.engine.version}"
                )
            error = receiving.error or ("still receiving" if receiving.thread.is_alive() else None)
            if error is not None:
                sync.fail(error)
                raise WeightSyncError(
                    f"collective sync {sync_id}: {error}; the weight group is dropped (the learner "
                    f"re-initialises it), still serving version {sync.engine.version}"
                )
            sync.writer = None  # every broadcast landed
            return sync.commit(sync_id, version)

    def _drop_group(self) -> None:
        self._group = None


class _Receiving:
    """The broadcasts of one collective sync, received into staging buffers on a daemon thread (the sync's
    `receiver.Writer`: abandoned, it drops the group, which it leaves mid-collective)."""

    def __init__(
        self,
        sync_id: str,
        group: WeightGroup,
        destinations: list[torch.Tensor],
        drop_group: Callable[[], None],
    ) -> None:
        self.sync_id = sync_id
        self.group = group
        self.error: str | None = None
        self._drop_group = drop_group
        self.thread = threading.Thread(
            target=self._run, args=(destinations,), name=f"weight-group-{sync_id[:8]}", daemon=True
        )

    def abandon(self) -> None:
        self._drop_group()  # its broadcasts cannot be cancelled

    def _run(self, destinations: list[torch.Tensor]) -> None:
        try:
            for tensor in destinations:
                self.group.broadcast(tensor)
        except GroupError as exc:
            self.error = str(exc)
