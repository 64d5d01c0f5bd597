"""The server's receivers over the one staging they share (`weightsync.receiver.WeightSync`): a sync
aborted or superseded while a chunk streams in gives up the buffers it writes, and a server builds only
the receivers of its configured transports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stagectl.engines.fake import FakeEngine
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.weightsync.disk import DiskReceiver
from stagectl.weightsync.errors import WeightSyncError
from stagectl.weightsync.factory import build_receivers
from stagectl.weightsync.http import HttpReceiver
from stagectl.weightsync.receiver import WeightSync
from stagectl.weightsync.wire import encode_chunks


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((4, 4), value), "b": torch.full((8,), value)}


def _receivers(tmp_path: Path) -> tuple[HttpReceiver, DiskReceiver, FakeEngine]:
    engine = FakeEngine(_state(0.0))
    sync = WeightSync(engine)
    return HttpReceiver(sync), DiskReceiver(sync, [tmp_path]), engine


@pytest.mark.parametrize("how", ["abort", "supersede"])
def test_a_sync_dropped_mid_chunk_refuses_that_chunk_and_keeps_serving(tmp_path: Path, how: str) -> None:
    http, _, engine = _receivers(tmp_path)
    first, second = encode_chunks(_state(1.0), 64)  # "a" (64 bytes), "b" (32 bytes)
    http.add_chunk("s", 0, first.digest, 1, first.data)
    streaming = http.begin_chunk("s", 1, second.digest, 1)
    streaming.feed(second.data[:10])
    if how == "abort":
        assert http.sync.abort("s") and not http.sync.abort("s")
    else:  # a new sync's first chunk (its client died mid-chunk and started again)
        (whole,) = encode_chunks(_state(2.0), 1 << 20)
        http.add_chunk("t", 0, whole.digest, 2, whole.data)
    streaming.feed(second.data[10:])  # the rest still arrives: it lands in buffers no sync holds
    with pytest.raises(WeightSyncError, match="aborted or superseded; still serving version 0"):
        http.finish_chunk(streaming)
    assert engine.version == 0 and http.sync.num_failed_syncs == 1
    if how == "supersede":  # the new sync is intact
        http.commit("t", 2, 1)
        assert engine.version == 2 and torch.equal(engine.weights["a"], _state(2.0)["a"])
    with pytest.raises(WeightSyncError, match="unknown weight sync 's'"):
        http.commit("s", 1, 2)


def test_http_and_disk_share_one_staging_and_version(tmp_path: Path) -> None:
    http, disk, engine = _receivers(tmp_path)
    save_file(_state(3.0), str(tmp_path / "w.safetensors"))
    disk.load_from_disk(str(tmp_path / "w.safetensors"), 3)
    (chunk,) = encode_chunks(_state(4.0), 1 << 20)
    with pytest.raises(WeightSyncError, match="target version 2 is not above the serving version 3"):
        http.add_chunk("old", 0, chunk.digest, 2, chunk.data)
    assert http.sync.num_failed_syncs == 1
    http.add_chunk("new", 0, chunk.digest, 4, chunk.data)
    http.commit("new", 4, 1)
    assert engine.version == 4 and http.sync.num_syncs == 2


def test_a_disk_sync_of_a_path_the_system_cannot_look_at_is_refused_not_an_error(tmp_path: Path) -> None:
    """A name longer than the file system takes raised OSError (ENAMETOOLONG) from the `is_file` check: a 500."""
    _, disk, engine = _receivers(tmp_path)
    with pytest.raises(WeightSyncError, match=r"not an existing \.safetensors file; still serving version 0"):
        disk.load_from_disk(str(tmp_path / ("w" * 5000 + ".safetensors")), 1)
    assert engine.version == 0


def test_a_server_builds_only_its_transports_receivers() -> None:
    engine = FakeEngine(_state(0.0))
    only_disk = RolloutService(engine, ServerSettings(weight_transports=frozenset({"disk"})))
    assert only_disk.http is None and only_disk.collective is None and only_disk.disk is not None
    every = RolloutService(engine, ServerSettings())
    assert every.http is not None and every.collective is not None and every.disk is not None
    assert every.http.sync is every.collective.sync is every.disk.sync is every.sync


def test_an_http_commit_cannot_end_another_transports_sync(tmp_path: Path) -> None:
    http, _, engine = _receivers(tmp_path)
    with http.sync.lock:
        http.sync.start("g", "collective", 1, None)  # what GroupReceiver does at group/start
    with pytest.raises(WeightSyncError, match=r"came on transport 'collective'.*group/finish"):
        http.commit("g", 1, 0)
    assert engine.version == 0


def test_build_receivers_refuses_a_transport_it_does_not_build(tmp_path: Path) -> None:
    sync = WeightSync(FakeEngine(_state(0.0)))
    with pytest.raises(ValueError, match=r"\['shm'\] are not built"):
        build_receivers(sync, {"http", "shm"}, [tmp_path])
    built = build_receivers(sync, {"http"}, [tmp_path])
    assert built.http is not None and built.collective is None and built.disk is None
