"""Full weight-sync speed over loopback, `http` (chunked safetensors to `/update_weights/`) vs `disk`
(a safetensors snapshot loaded by path), for ~100 MB and ~1 GB float32 state dicts.

The server is a separate process (this module with `--serve`) running the real app over the fake
echo engine holding tensors of the same shapes, so the numbers are transport + staging + checks +
swap, without a model. Transports are timed alternately. MB/s = state-dict bytes / push seconds.

Run: `python -m bench.bench_weight_sync`. `run()` returns the numbers as a dict.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from stagectl.rollout.engines.fake import default_weights
from stagectl.rollout.launcher import ServerProcess

STATE_MIB = 100
SIZES_MIB = (100, 1000)
BLOCK_MIB = 4
CHUNK_MIB = 64


def _serve(weights_dir: str, state_mib: int = STATE_MIB) -> None:
    """The benchmark's server process: the real app over a fake engine holding `state_mib` of weights."""
    from stagectl.rollout.app import build_app
    from stagectl.rollout.engines.fake import FakeEngine
    from stagectl.rollout.service import RolloutService, ServerSettings
    from stagectl.rollout.serving import bind_socket, serve

    engine = FakeEngine(default_weights(state_mib, BLOCK_MIB))
    settings = ServerSettings(weight_dirs=[Path(weights_dir)], max_weight_chunk_bytes=2 * CHUNK_MIB << 20)
    serve(build_app(RolloutService(engine, settings)), bind_socket("127.0.0.1", 0))


def run(repeats: int = 3, sizes_mib: tuple[int, ...] = SIZES_MIB) -> dict[str, object]:
    sizes = [run_size(repeats if mib <= 200 else 2, mib) for mib in sizes_mib]
    out: dict[str, object] = {"sizes": sizes}
    largest = sizes[-1]
    assert isinstance(largest, dict)
    http_s = largest["http"]["seconds_median"]
    out["sync_fraction"] = (
        f"A {largest['state_mb']:.0f} MB full sync over http takes {http_s:.2f} s here: at `sync_every_steps: 1` it "
        f"stays under 10% of a training step when a step takes more than {10 * http_s:.0f} s "
        f"({http_s / 4 * 10:.0f} s at `sync_every_steps: 4`). The async benchmark reports the tiny model's real "
        "sync share (`time/weight_sync_s`)."
    )
    return out


def run_size(repeats: int, state_mib: int) -> dict[str, object]:
    from stagectl.rollout.client import RolloutClient

    g = torch.Generator().manual_seed(0)
    state = {
        name: torch.randn(t.shape, generator=g) for name, t in default_weights(state_mib, BLOCK_MIB).items()
    }
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
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
        url = server.wait_listening(120)
        seconds: dict[str, list[float]] = {"http": [], "disk": []}
        try:
            with RolloutClient([url], chunk_bytes=CHUNK_MIB << 20, disk_dir=weights_dir) as client:
                version = 0
                for _ in range(repeats):
                    for transport in ("http", "disk"):
                        version += 1
                        report = client.push_weights(state, version, transport=transport)  # type: ignore[arg-type]
                        seconds[transport].append(report.seconds)
                final_version = client.versions()[0].version
        finally:
            server.stop()
    out: dict[str, object] = {"state_mb": num_bytes / 1e6, "num_tensors": len(state), "chunk_mib": CHUNK_MIB}
    for transport, times in seconds.items():
        out[transport] = {
            "seconds_median": statistics.median(times),
            "mb_per_s_median": num_bytes / 1e6 / statistics.median(times),
            "mb_per_s_best": num_bytes / 1e6 / min(times),
        }
    out["final_version"] = final_version
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", metavar="WEIGHTS_DIR", help="internal: run the benchmark's server")
    parser.add_argument("--mib", type=int, default=STATE_MIB, help="internal: the server's state size")
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve, args.mib)
        return
    result = run()
    sizes = result["sizes"]
    assert isinstance(sizes, list)
    for size in sizes:
        print(f"weight sync over loopback: {size['state_mb']:.1f} MB in {size['num_tensors']} tensors")
        for transport in ("http", "disk"):
            row = size[transport]
            print(
                f"  {transport:4s} median {row['seconds_median']:.3f} s  "
                f"{row['mb_per_s_median']:7.1f} MB/s (best {row['mb_per_s_best']:.1f})"
            )
    print(result["sync_fraction"])


if __name__ == "__main__":
    main()
