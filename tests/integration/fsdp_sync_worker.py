"""One rank of `test_weight_sync_fsdp` (run with torchrun, 2 gloo ranks): a small model that only rank 0
builds with values (rank 1 builds it on the meta device) sharded with `sharding.shard_from_rank0`, then synced by the learner's `WeightPublisher` to a fake-engine server that rank 0 runs in process, over each
transport in turn. After each sync rank 0 checks the served weights against the whole state dict
gathered the old way (`sharding.full_state_dict`) and writes one JSON line per sync. Before the syncs every
rank writes whether its gathered weights and its buffers equal a model built with values on that rank.

A last sync goes to a server whose first tensor has another shape: the push is refused at its first chunk,
with the rest of the stream untaken, and every rank must still leave the sync (the ranks' all-gathers
pair up) with the server's message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist
from torch import nn

from stagectl import dist
from stagectl.engines.fake import FakeEngine
from stagectl.learner import sharding
from stagectl.learner.channel_b.publisher import WeightPublisher
from stagectl.learner.precision import Precision
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.weightsync.client import WeightSyncClient

STORAGE = torch.bfloat16
CHUNK_BYTES = 300  # smaller than most tensors: they go out in row ranges over several chunks


class Net(nn.Module):
    _no_split_modules = ("Linear",)  # what `sharding.shard` wraps on its own, as a model's blocks

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 16)  # 37 rows: uneven shards over 2 ranks
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 5)
        # like a rotary embedding's frequencies: computed at construction, never in a state dict
        self.register_buffer("freqs", torch.arange(8.0) / 8, persistent=False)


def _serve(shapes: dict[str, torch.Tensor]) -> tuple[ThreadedServer, FakeEngine]:
    engine = FakeEngine({name: torch.zeros(t.shape, dtype=STORAGE) for name, t in shapes.items()})
    settings = ServerSettings(weight_dirs=[Path(sys.argv[1])])
    return ThreadedServer(build_app(RolloutService(engine, settings))).start(), engine


def _report(rank: int, row: dict[str, object]) -> None:
    """One JSON line to this rank's own file: the ranks share torchrun's stdout, and two ranks printing at
    once have interleaved two lines into one (a CI run failed on it)."""
    with open(Path(sys.argv[1]) / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def main() -> None:
    world = dist.read_world()
    torch_dist.init_process_group("gloo")
    torch.manual_seed(0)
    reference = Net()  # what every rank should hold once rank 0 has sent its values
    plain = {name: t.detach().clone() for name, t in reference.state_dict().items()}
    if world.is_main:
        model = reference
    else:
        with torch.device("meta"):
            model = Net()
    precision = Precision(torch.float32, None, STORAGE, False)
    sharding.shard_from_rank0(model, precision, torch.device("cpu"), world.world_size, is_main=world.is_main)
    assert sharding.is_sharded(model)
    loaded = sharding.full_state_dict(model)
    same = all(torch.equal(loaded[name], plain[name]) for name in plain)
    same_buffers = torch.equal(model.freqs, torch.arange(8.0) / 8)
    _report(world.rank, {"rank": world.rank, "loaded_equal": same, "buffers_equal": same_buffers})
    servers = []
    if world.is_main:
        good = _serve(plain)
        bad = _serve({**plain, "embed.weight": torch.zeros(38, 16)})  # the first tensor: wrong shape
        servers = [good, bad]
    url = dist.broadcast_object(servers[0][0].url if world.is_main else "")
    for transport in ("http", "collective", "disk"):
        client = WeightSyncClient(
            [url], transport=transport, chunk_bytes=CHUNK_BYTES, disk_dir=Path(sys.argv[1]) / "weight_sync"
        )
        publisher = WeightPublisher(client, model, world, num_updates=1, storage_dtype=STORAGE)
        with torch.no_grad():  # new weights for this sync, different on every shard
            for param in model.parameters():
                param.to_local().add_(torch.randn_like(param.to_local()))
        outcome = publisher.sync(None)
        expected = sharding.full_state_dict(model, dtype=STORAGE, keep=world.is_main)
        if world.is_main:
            served = servers[0][1].weights
            equal = sorted(name for name in expected if torch.equal(served[name], expected[name]))
            row = {"transport": transport, "status": outcome.status, "version": outcome.version}
            _report(world.rank, row | {"equal": equal, "names": sorted(expected)})
        client.close()
    bad_url = dist.broadcast_object(servers[1][0].url if world.is_main else "")
    client = WeightSyncClient([bad_url], chunk_bytes=CHUNK_BYTES)
    publisher = WeightPublisher(client, model, world, num_updates=1, storage_dtype=STORAGE)
    try:
        publisher.sync(None)
        refused = ""
    except dist.SharedError as exc:
        refused = str(exc)
    _report(world.rank, {"rank": world.rank, "refused": refused})
    client.close()
    dist.barrier()
    for server, _ in servers:
        server.stop()
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
