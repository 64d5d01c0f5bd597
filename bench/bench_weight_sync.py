"""Weight sync speed over loopback at real sizes (~105 MB and ~1 GB float32 state dicts), every transport
against the machine's own limits measured in the same run on the same bytes:

- `raw socket`: the bytes sent over a plain loopback TCP socket to another process (`sendall` of the
  tensors' memory, `recv_into` one reused buffer) -- the ceiling for `http`;
- `memcpy`: the bytes copied once into resident buffers;
- `tmpfs write+read`: the bytes written to a /dev/shm file and read back into resident buffers -- the
  ceiling for `disk` with its `disk_dir` on a tmpfs.

Transports: `http` (streamed zero-copy chunks, XXH3-128, read by the server's weight-stream port straight into
the staging, swapped on commit), `collective` (a gloo weight group: one broadcast per tensor after a
metadata check; formed at the warm-up), `disk` (one snapshot under the run directory loaded
by path), `delta` (http after 1% of the elements changed, scattered; MB/s counts the whole state dict, `sent MB`
what went out). The server is a separate process (this module with `--serve`) running the
real app over the fake echo engine holding tensors of the same shapes, so the figures are transport +
checks + staging + swap, without a model. One warm-up sync first (the server allocates its staging).

Delta economics: after real AdamW steps of the tiny model (fp32 and bf16, lr 1e-3 .. 1e-6), the share of
elements that stayed bit-identical and the bytes a delta sends (sparse index + value where cheaper).

Run: `python -m bench weight_sync` (or `python -m bench.bench_weight_sync`). `run()` returns a dict.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from stagectl.engines.fake import default_weights
from stagectl.server.launcher import ServerProcess
from stagectl.weightsync.base import Transport
from stagectl.weightsync.delta import bits_np
from stagectl.weightsync.wire import byte_view

SIZES_MIB = (100, 1000)
BLOCK_MIB = 4
CHUNK_MIB = 64
DELTA_CHANGED = 0.01  # share of elements changed between delta pushes (bf16 at lr ~1e-5 sees ~6%)
TRANSPORTS = ("http", "disk", "delta", "collective")  # shm was removed (#25)
LRS = (1e-3, 1e-4, 1e-5, 1e-6)
TMPFS_DIR = Path("/dev/shm")  # the tmpfs baseline


SENDERS: tuple[Transport, ...] = ("http", "disk", "collective")  # one client each


def _serve(weights_dir: str, state_mib: int) -> None:
    """The benchmark's server process: the real app over a fake engine holding `state_mib` of weights."""
    from stagectl.engines.fake import FakeEngine
    from stagectl.server.app import build_app
    from stagectl.server.service import RolloutService, ServerSettings
    from stagectl.server.serving import bind_socket, serve

    engine = FakeEngine(default_weights(state_mib, BLOCK_MIB))
    settings = ServerSettings(weight_dirs=[Path(weights_dir)], max_weight_chunk_bytes=2 * CHUNK_MIB << 20)
    serve(build_app(RolloutService(engine, settings)), bind_socket("127.0.0.1", 0))


def _sink() -> None:
    """The raw-socket receiver process: print the port, take one connection, read to EOF, answer the count."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    print(server.getsockname()[1], flush=True)
    while True:
        conn, _ = server.accept()
        buffer = memoryview(bytearray(1 << 20))
        total = 0
        while n := conn.recv_into(buffer):
            total += n
        conn.sendall(str(total).encode())
        conn.close()


def raw_socket_s(state: dict[str, torch.Tensor], port: int) -> float:
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for tensor in state.values():
            conn.sendall(byte_view(tensor))
        conn.shutdown(socket.SHUT_WR)
        int(conn.recv(64))
    return time.perf_counter() - start


def memcpy_s(state: dict[str, torch.Tensor], into: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    for name, tensor in state.items():  # numpy: one plain memcpy per tensor, no thread pool
        np.copyto(bits_np(into[name]), bits_np(tensor))
    return time.perf_counter() - start


def tmpfs_s(state: dict[str, torch.Tensor], into: dict[str, torch.Tensor]) -> float:
    path = TMPFS_DIR / f"stagectl-bench-{os.getpid()}.bin"
    start = time.perf_counter()
    try:
        with path.open("wb") as f:
            for tensor in state.values():
                f.write(byte_view(tensor))
        with path.open("rb", buffering=0) as f:
            for tensor in into.values():
                f.readinto(byte_view(tensor))  # type: ignore[attr-defined]
    finally:
        path.unlink(missing_ok=True)
    return time.perf_counter() - start


def _touch_elements(state: dict[str, torch.Tensor], g: torch.Generator) -> None:
    """Change DELTA_CHANGED of each tensor's elements, scattered at random."""
    for tensor in state.values():
        flat = tensor.view(-1)
        chosen = torch.randint(0, flat.numel(), (max(1, round(DELTA_CHANGED * flat.numel())),), generator=g)
        flat[chosen] += 1.0


def run_size(repeats: int, state_mib: int) -> dict[str, object]:
    from stagectl.weightsync.client import WeightSyncClient

    g = torch.Generator().manual_seed(0)
    state = {
        name: torch.randn(t.shape, generator=g) for name, t in default_weights(state_mib, BLOCK_MIB).items()
    }
    into = {name: torch.ones_like(t) for name, t in state.items()}  # resident pages
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    seconds: dict[str, list[float]] = {k: [] for k in ("raw_socket", "memcpy", "tmpfs", *TRANSPORTS)}
    delta_sent: list[int] = []
    sink = subprocess.Popen(
        [sys.executable, "-m", "bench.bench_weight_sync", "--sink"], stdout=subprocess.PIPE, text=True
    )
    with tempfile.TemporaryDirectory() as weights_dir:
        argv = [
            sys.executable,
            "-m",
            "bench.bench_weight_sync",
            "--serve",
            weights_dir,
            "--mib",
            str(state_mib),
        ]
        server = ServerProcess(argv)
        try:
            url = server.wait_listening(120)
            assert sink.stdout is not None
            port = int(sink.stdout.readline())
            clients = {
                transport: WeightSyncClient(
                    [url], transport=transport, chunk_bytes=CHUNK_MIB << 20, disk_dir=weights_dir
                )
                for transport in SENDERS
            }
            with (
                clients["http"] as client,
                clients["disk"],
                clients["collective"],
                WeightSyncClient([url], chunk_bytes=CHUNK_MIB << 20, delta=True) as delta,
            ):
                version = 1
                client.push_weights(state, version)  # warm-up: the server allocates its staging
                version += 1
                clients["collective"].push_weights(state, version)  # warm-up: the group forms
                for _ in range(repeats):  # every measurement once per round, so noise hits them alike
                    seconds["raw_socket"].append(raw_socket_s(state, port))
                    seconds["memcpy"].append(memcpy_s(state, into))
                    seconds["tmpfs"].append(tmpfs_s(state, into))
                    for transport in SENDERS:
                        version += 1
                        report = clients[transport].push_weights(state, version)
                        seconds[transport].append(report.seconds)
                    version += 1
                    delta.push_weights(state, version, base_version=version - 1)  # full: the delta's base
                    _touch_elements(state, g)
                    version += 1
                    report = delta.push_weights(state, version, base_version=version - 1)
                    assert report.delta, "the delta push fell back to a full sync"
                    seconds["delta"].append(report.seconds)
                    delta_sent.append(report.num_bytes)
                final_version = client.versions()[0].version
        finally:
            server.stop()
            sink.kill()
            sink.wait()
    mb = num_bytes / 1e6
    out: dict[str, object] = {
        "state_mb": mb,
        "num_tensors": len(state),
        "chunk_mib": CHUNK_MIB,
        "repeats": repeats,
    }
    for key, times in seconds.items():
        out[key] = {
            "seconds_median": statistics.median(times),
            "mb_per_s_median": mb / statistics.median(times),
            "mb_per_s_best": mb / min(times),
        }
    out["delta_sent_mb"] = statistics.median(delta_sent) / 1e6
    raw, tmpfs = out["raw_socket"]["mb_per_s_median"], out["tmpfs"]["mb_per_s_median"]  # type: ignore[index]
    out["ratios"] = {
        "http_over_raw_socket": out["http"]["mb_per_s_median"] / raw,  # type: ignore[index]
        "disk_over_raw_socket": out["disk"]["mb_per_s_median"] / raw,  # type: ignore[index]
        "delta_over_raw_socket": out["delta"]["mb_per_s_median"] / raw,  # type: ignore[index]
        "collective_over_raw_socket": out["collective"]["mb_per_s_median"] / raw,  # type: ignore[index]
        "disk_over_tmpfs": out["disk"]["mb_per_s_median"] / tmpfs,  # type: ignore[index]
    }
    out["final_version"] = final_version
    return out


def unchanged_fractions(
    model_name: str = "builtin:tiny-qwen2.5-vl", steps: int = 3
) -> list[dict[str, object]]:
    """After each of `steps` AdamW steps on random tokens (every parameter trainable, weight decay 0 as
    `training.weight_decay` defaults): the share of elements bit-identical to the step before, the same
    over the parameters that got a gradient, and the delta's bytes as a share of the state dict; medians
    over the steps after the first (Adam's first step moves every element with a gradient by ~lr)."""
    from stagectl.models.loading import load_bundle
    from stagectl.weightsync.delta import DeltaTracker, bits

    rows = []
    for dtype in ("float32", "bfloat16"):
        for lr in LRS:
            torch.manual_seed(0)
            model = load_bundle(model_name, torch_dtype=dtype).model  # type: ignore[arg-type]
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            tracker = DeltaTracker()
            tracker.pushed(0, model.state_dict(), None)
            g = torch.Generator().manual_seed(0)
            per_step: dict[str, list[float]] = {"elements": [], "trained_elements": [], "delta_bytes": []}
            for _ in range(steps):
                before = {n: t.detach().clone() for n, t in model.state_dict().items()}
                ids = torch.randint(0, 500, (2, 32), generator=g)
                model(input_ids=ids, labels=ids).loss.backward()
                trained = {n for n, p in model.named_parameters() if p.grad is not None}
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                state = model.state_dict()
                same = {n: int((bits(t) == bits(before[n])).sum()) for n, t in state.items()}
                numel = {n: t.numel() for n, t in state.items()}
                per_step["elements"].append(sum(same.values()) / sum(numel.values()))
                per_step["trained_elements"].append(
                    sum(same[n] for n in trained) / max(1, sum(numel[n] for n in trained))
                )
                plan = tracker.plan(state, 64 << 20)
                per_step["delta_bytes"].append(plan.wire_bytes / plan.total_bytes)
                tracker.pushed(0, state, plan)
            row: dict[str, object] = {"dtype": dtype, "lr": lr}
            row.update({k: statistics.median(v[1:]) for k, v in per_step.items()})
            rows.append(row)
    return rows


def run(repeats: int = 3, sizes_mib: tuple[int, ...] = SIZES_MIB) -> dict[str, object]:
    load_start = os.getloadavg()[0]
    sizes = [run_size(repeats if mib <= 200 else 2, mib) for mib in sizes_mib]
    out: dict[str, object] = {"sizes": sizes, "unchanged": unchanged_fractions()}
    out["loadavg"] = [load_start, os.getloadavg()[0]]  # the machine is shared: how busy it was
    largest = sizes[-1]
    http_s = largest["http"]["seconds_median"]  # type: ignore[index]
    disk_s = largest["disk"]["seconds_median"]  # type: ignore[index]
    out["sync_fraction"] = (
        f"A {largest['state_mb']:.0f} MB full sync takes {http_s:.2f} s over http and {disk_s:.2f} s over disk here: "
        f"at `sync_every_steps: 1` it stays under 10% of a training step when a step takes more than "
        f"{10 * http_s:.0f} s (http) or {10 * disk_s:.0f} s (disk)."
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", metavar="WEIGHTS_DIR", help="internal: run the benchmark's server")
    parser.add_argument("--sink", action="store_true", help="internal: run the raw-socket receiver")
    parser.add_argument("--mib", type=int, default=SIZES_MIB[0], help="internal: the server's state size")
    args = parser.parse_args()
    if args.sink:
        _sink()
        return
    if args.serve:
        _serve(args.serve, args.mib)
        return
    from bench.markdown import weight_sync

    print("\n".join(weight_sync(run())))


if __name__ == "__main__":
    main()
