"""Rollout-server throughput of the `hf` engine (tiny Qwen2.5-VL) with batching on vs off, at 8
concurrent requests: 8 client threads, each sending one request per round over HTTP to an in-process
server. Batching on: `max_batch_size=8, batch_wait_ms=10`; off: `max_batch_size=1`. The two servers
share one loaded model and are timed alternately, so machine-load drift hits both alike.

Run: `python -m bench.bench_rollout`. `run()` returns the numbers as a dict.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

from stagectl.engines.hf import HFEngine
from stagectl.inference.client import RolloutClient, detection_request
from stagectl.models.loading import load_bundle
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.wire.protocol import RequestConfig

MODEL = "builtin:tiny-qwen2.5-vl"
CONCURRENCY = 8
MAX_TOKENS = 32


def _images(root: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for k in range(CONCURRENCY):
        path = root / f"img{k}.png"
        Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def _round(clients: list[RolloutClient], images: list[Path], seed: int) -> tuple[float, int]:
    """One single-request call per client, all at once; returns (seconds, generated tokens)."""
    tokens = [0] * CONCURRENCY
    config = RequestConfig(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, return_details=True)

    def one(k: int) -> None:
        (out,) = clients[k].infer([detection_request([images[k]], "Find every object.")], config)
        tokens[k] = len(out.choices[0].token_ids or [])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(CONCURRENCY)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, sum(tokens)


def run(rounds: int = 5) -> dict[str, object]:
    bundle = load_bundle(MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        images = _images(Path(tmp))
        settings = ServerSettings(image_roots=[Path(tmp)])
        engines = {
            "batching_on": HFEngine(bundle, model_name=MODEL, max_batch_size=CONCURRENCY, batch_wait_ms=10),
            "batching_off": HFEngine(bundle, model_name=MODEL, max_batch_size=1, batch_wait_ms=0),
        }
        servers = {
            name: ThreadedServer(build_app(RolloutService(e, settings))).start()
            for name, e in engines.items()
        }
        clients = {name: [RolloutClient([s.url]) for _ in range(CONCURRENCY)] for name, s in servers.items()}
        times: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, int] = dict.fromkeys(engines, 0)
        try:
            for name in servers:  # warm-up (connections, first generate)
                _round(clients[name], images, seed=0)
            warm = {name: e.batch_sizes() for name, e in engines.items()}
            for r in range(rounds):
                for name in servers:
                    seconds, n = _round(clients[name], images, seed=1000 * (r + 1))
                    times[name].append(seconds)
                    tokens[name] += n
            histograms = {
                name: {
                    size: n - warm[name].get(size, 0)
                    for size, n in sorted(e.batch_sizes().items())
                    if n > warm[name].get(size, 0)
                }
                for name, e in engines.items()
            }
        finally:
            for name, server in servers.items():
                for client in clients[name]:
                    client.close()
                server.stop()
    out: dict[str, object] = {"concurrency": CONCURRENCY, "max_tokens": MAX_TOKENS, "rounds": rounds}
    for name in engines:
        total = sum(times[name])
        out[name] = {
            "requests_per_s": CONCURRENCY * rounds / total,
            "tokens_per_s": tokens[name] / total,
            "round_s_median": statistics.median(times[name]),
            "batch_sizes": histograms[name],
        }
    on, off = out["batching_on"], out["batching_off"]
    assert isinstance(on, dict) and isinstance(off, dict)
    out["throughput_ratio_on_over_off"] = on["requests_per_s"] / off["requests_per_s"]
    return out


def main() -> None:
    result = run()
    print(
        f"rollout hf engine, {CONCURRENCY} concurrent requests x {result['rounds']} rounds, {MAX_TOKENS} new tokens"
    )
    for name in ("batching_on", "batching_off"):
        row = result[name]
        assert isinstance(row, dict)
        print(
            f"  {name:13s} {row['requests_per_s']:7.2f} req/s  {row['tokens_per_s']:8.1f} tok/s  "
            f"round median {row['round_s_median']:.3f} s  batch sizes {row['batch_sizes']}"
        )
    print(f"  throughput ratio (on / off): {result['throughput_ratio_on_over_off']:.2f}")


if __name__ == "__main__":
    main()
