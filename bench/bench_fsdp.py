"""FSDP2 on 2 gloo ranks, measured where it costs host memory: a weight sync, gradient accumulation, loading.

The model is the tiny Qwen2.5-VL with a widened language model (`--layers` decoder layers of MLP width
`--intermediate`: 6 x 32768 gives ~290 MiB of float32 weights, the largest tensor 16 MiB), sharded with
the learner's own `sharding.shard` (one `fully_shard` per block, then the root), float32 masters.

Each measurement is its own pair of rank processes (`python -m bench.bench_fsdp --worker ...`). Peak
memory is the process's RSS high-water mark (VmHWM) after resetting it (`/proc/self/clear_refs` = 5) just
before the measured part, minus the RSS at that moment: the extra memory the part needed. glibc's malloc is
pinned to mmap every allocation of 64 KiB or more (`MALLOC_MMAP_THRESHOLD_`), so freed tensors leave the
RSS at once and an earlier part's freed memory cannot hide a later part's peak.

- `sync`: one warm-up sync, then one measured, to a fake-engine server in its own process holding the
  same tensors in bfloat16 (the storage dtype). `gathered` is what the learner did before streaming: the
  whole state dict gathered into rank 0's CPU memory in the storage dtype, then pushed
  (`sharding.full_state_dict` + `push_weights`); `streamed` is `WeightPublisher.sync` (a tensor at a time).
  Their times side by side: one pair of ranks alternating streamed and gathered http syncs, 4 of each.
- `load`: building the model and sharding it, every rank with the whole float32 model first (the learner
  before `shard_from_rank0`) or rank 0 alone with rank 1 on the meta device (`sharding.shard_from_rank0`).
- `accum`: 4 forward/backward micro-steps of 64 random token ids per optimizer step (the model's own LM
  loss), gradients kept unsharded until the last micro-step (`set_requires_gradient_sync(False)` before
  it, what the learner did before) or reduce-scattered on every micro-step (what it does now); peak extra
  memory and seconds per optimizer step over the steps after the first.

Run: `python -m bench fsdp` (rewrites its BENCHMARKS.md section), or `python -m bench.bench_fsdp` (JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
MODEL = "builtin:tiny-qwen2.5-vl"
MIB = 1 << 20
TIMING_ROUNDS = 4
SYNC_CASES = (  # (mode, transport, chunk MiB)
    ("gathered", "http", 64),
    ("streamed", "http", 64),
    ("streamed", "http", 16),
    ("gathered", "collective", 64),
    ("streamed", "collective", 64),
)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS; returns that RSS."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(
    layers: int = 6, intermediate: int = 32768, micro_steps: int = 4, steps: int = 3, tokens: int = 64
) -> dict[str, Any]:
    shape = {"layers": layers, "intermediate": intermediate}
    load = [
        {"mode": m, "ranks": _launch(["load", m], shape)}
        for m in ("every_rank", "rank0", "every_rank", "rank0")
    ]
    sync = [
        {"mode": m, "transport": t, "chunk_mib": c, "ranks": _launch(["sync", m, t, str(c)], shape)}
        for m, t, c in SYNC_CASES
    ]
    timing = {"ranks": _launch(["sync", "alternate", "http", "64"], shape)}
    accum = [
        {
            "reduce_every_micro_step": every,
            "ranks": _launch(["accum", str(int(every)), str(micro_steps), str(steps), str(tokens)], shape),
        }
        for every in (False, True, False, True)  # twice each, interleaved: the spread of one machine's noise
    ]
    return {
        "model": MODEL,
        **shape,
        "micro_steps": micro_steps,
        "steps": steps,
        "tokens": tokens,
        "load": load,
        "sync": sync,
        "sync_timing": timing,
        "accum": accum,
    }


def _launch(args: list[str], shape: dict[str, int]) -> list[dict[str, Any]]:
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="bench_fsdp.") as tmp:
        procs = []
        for rank in range(2):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "MALLOC_MMAP_THRESHOLD_": "65536",
                "PYTHONPATH": str(ROOT),
            }
            cmd = [sys.executable, "-m", "bench.bench_fsdp", "--worker", str(Path(tmp) / f"rank{rank}.json")]
            cmd += ["--layers", str(shape["layers"]), "--intermediate", str(shape["intermediate"]), *args]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env))
        codes = [p.wait(timeout=900) for p in procs]
        if any(codes):
            raise RuntimeError(f"bench_fsdp ranks exited {codes} ({args})")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
        print(f"   {' '.join(args)}: {json.dumps(ranks)}", file=sys.stderr, flush=True)
        return ranks


def _model(layers: int, intermediate: int, from_rank0: bool = False) -> Any:
    """The widened model, sharded: every rank builds it with values (`from_rank0=False`), or only rank 0
    does and rank 1 builds it on meta and gets its shards from rank 0 (what the learner does now)."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from stagectl.learner import sharding
    from stagectl.learner.precision import Precision
    from stagectl.models.tiny import resolve_builtin

    config = AutoConfig.from_pretrained(resolve_builtin(MODEL))
    text = config.text_config
    text.intermediate_size, text.num_hidden_layers = intermediate, layers
    text.layer_types = [text.layer_types[0]] * layers
    torch.manual_seed(0)
    is_main = os.environ["RANK"] == "0"
    precision = Precision(torch.float32, None, torch.bfloat16, False)
    if not from_rank0:
        model = Qwen2_5_VLForConditionalGeneration(config)
        sharding.shard(model, precision, torch.device("cpu"), 2)
        return model
    if is_main:
        model = Qwen2_5_VLForConditionalGeneration(config)
    else:
        with torch.device("meta"):
            model = Qwen2_5_VLForConditionalGeneration(config)
    sharding.shard_from_rank0(model, precision, torch.device("cpu"), 2, is_main=is_main)
    return model


def _serve(specs_path: str) -> None:
    """The server process: the real app over a fake engine holding zeros of the announced specs."""
    import torch

    from stagectl.engines.fake import FakeEngine
    from stagectl.server.app import build_app
    from stagectl.server.service import RolloutService, ServerSettings
    from stagectl.server.serving import bind_socket, serve

    specs = json.loads(Path(specs_path).read_text())
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    engine = FakeEngine(
        {name: torch.zeros(shape, dtype=dtypes[dtype]) for name, (shape, dtype) in specs.items()}
    )
    serve(build_app(RolloutService(engine, ServerSettings())), bind_socket("127.0.0.1", 0))


def _sync_worker(model: Any, rank: int, mode: str, transport: str, chunk_mib: int) -> dict[str, Any]:
    import torch

    from stagectl import dist
    from stagectl.dist import World
    from stagectl.learner import sharding
    from stagectl.learner.channel_b.publisher import WeightPublisher
    from stagectl.server.launcher import ServerProcess
    from stagectl.weightsync.client import WeightSyncClient

    world = World(rank, rank, 2)
    stream = sharding.GatheredStream(model, torch.bfloat16)
    state_bytes = stream.stream().num_bytes
    server = None
    url = "http://127.0.0.1:9"  # the other rank's client never connects
    if world.is_main:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({n: [list(s.shape), s.dtype] for n, s in stream.specs.items()}, f)
        server = ServerProcess([sys.executable, "-m", "bench.bench_fsdp", "--serve", f.name], cwd=ROOT)
        url = server.wait_listening(120)
    del stream
    client = WeightSyncClient([url], transport=transport, chunk_bytes=chunk_mib * MIB)  # type: ignore[arg-type]
    publisher = WeightPublisher(client, model, world, num_updates=1, storage_dtype=torch.bfloat16)
    seconds, extra = [], []
    # a warm-up (the server allocates its staging, the weight group forms), then measured; `alternate`:
    # streamed and gathered syncs in turn, `TIMING_ROUNDS` of each, for their times side by side
    modes = [mode, mode] if mode != "alternate" else ["streamed"] + ["streamed", "gathered"] * TIMING_ROUNDS
    by_mode: dict[str, list[float]] = {"streamed": [], "gathered": []}
    for k, mode in enumerate(modes):
        dist.barrier()
        base = _reset_peak()
        start = time.perf_counter()
        if mode == "streamed":
            outcome = publisher.sync(None)
            assert outcome.status == "ok", outcome.message
        else:  # the learner before streaming: everything gathered on rank 0, then pushed
            state = sharding.full_state_dict(model, dtype=torch.bfloat16, keep=world.is_main)
            if world.is_main:
                client.push_weights(state, publisher.ver + 1)
            publisher.clock.advance(publisher.ver + 1)
            del state
        seconds.append(time.perf_counter() - start)
        extra.append(_status_bytes("VmHWM") - base)
        if k:
            by_mode[mode].append(seconds[-1])
    client.close()
    if server is not None:
        server.stop()
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())  # whole, float32
    return {
        "peak_extra_mib": extra[-1] / MIB,
        "seconds": seconds[-1],
        "state_mib": state_bytes / MIB,
        "largest_tensor_float32_mib": largest / MIB,
        "seconds_by_mode": by_mode,
    }


def _accum_worker(
    model: Any, reduce_every: bool, micro_steps: int, steps: int, tokens: int
) -> dict[str, Any]:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    seconds, extra = [], []
    for step in range(steps):
        base = _reset_peak()
        start = time.perf_counter()
        for k in range(micro_steps):
            model.set_requires_gradient_sync(reduce_every or k == micro_steps - 1)
            ids = torch.randint(0, 1000, (1, tokens), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step creates AdamW's state
            seconds.append(time.perf_counter() - start)
            extra.append(_status_bytes("VmHWM") - base)
    return {"peak_extra_mib": max(extra) / MIB, "seconds_per_step": statistics.median(seconds)}


def _worker(out: Path, layers: int, intermediate: int, args: list[str]) -> None:
    import torch
    import torch.distributed as torch_dist

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", rank=rank, world_size=2)
    if args[0] == "load":
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration  # noqa: F401  (imported before the reset)

        import stagectl.learner.sharding  # noqa: F401

        init_device_mesh("cpu", (2,))
        base = _reset_peak()
        model = _model(layers, intermediate, from_rank0=args[1] == "rank0")
        gc.collect()
        result = {"peak_extra_mib": (_status_bytes("VmHWM") - base) / MIB}
        result["held_after_mib"] = (_status_bytes("VmRSS") - base) / MIB
    elif args[0] == "sync":
        result = _sync_worker(_model(layers, intermediate), rank, args[1], args[2], int(args[3]))
    else:
        model = _model(layers, intermediate)
        result = _accum_worker(model, bool(int(args[1])), int(args[2]), int(args[3]), int(args[4]))
    result["rss_mib"] = _status_bytes("VmRSS") / MIB
    out.write_text(json.dumps(result))
    torch_dist.barrier()
    torch_dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", type=Path)
    parser.add_argument("--serve")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--intermediate", type=int, default=32768)
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve)
    elif args.worker:
        _worker(args.worker, args.layers, args.intermediate, args.rest)
    else:
        print(json.dumps(run(args.layers, args.intermediate), indent=2))


if __name__ == "__main__":
    main()
