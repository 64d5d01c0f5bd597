"""Measured per-rank memory of the tiny Qwen2.5-VL's training step next to the memory model's estimate
(`stagectl.memory`): 1 rank and 2 gloo ranks with DDP (and FSDP2 with `--parallelism fsdp`).

Each rank is its own process (`python -m bench.bench_memory --worker ...`, one intra-op thread). It loads
the model, packs Channel-A segments of the synthetic shapes into one micro-batch of up to
`--global-max-length` tokens and runs `--steps` optimizer steps (the learner's own `PackRunner`
forward/backward, AdamW). Measured per rank:

- torch-tracked peak bytes by kind: `torch.distributed._tools.mem_tracker.MemTracker` counts every tensor
  storage by what it is (parameter, gradient, optimizer state, activation, temporary) through a torch
  dispatch mode; on CPU this is the analogue of `torch.cuda.max_memory_allocated`. Its peak is taken
  over the steps after the first (the first creates the optimizer state);
- process peak RSS (VmHWM) and the RSS before the model loads (Python + torch + transformers).

The estimate is computed for the same knobs (world size, parallelism, float32, the micro-batch's real
token count and image-token share).

Run: `python -m bench.bench_memory [--parallelism ddp|fsdp] [--world-sizes 1 2]` (prints JSON), or
`python -m bench memory` (ddp on 1 and 2 ranks, fsdp on 2, and 1 rank with gradient checkpointing;
recorded in BENCHMARKS.md). `fsdp` wraps the
model here with FSDP2 `fully_shard` per decoder layer and vision block, then the root (the layout of
`training.parallelism: fsdp`); once the learner builds that itself, the worker should call it instead.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
MODEL = "builtin:tiny-qwen2.5-vl"
TRACKED = ("Parameter", "Gradient", "Optstate", "Activation", "Temp", "Buffer", "Other")


def _rss_bytes(field: str) -> int:
    """`VmRSS` (now) or `VmHWM` (peak) of this process from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(
    topologies: tuple[tuple[str, int, bool], ...] = (
        ("ddp", 1, False),
        ("ddp", 2, False),
        ("fsdp", 2, False),
        ("ddp", 1, True),
    ),
    global_max_length: int = 2048,
    steps: int = 3,
) -> dict[str, Any]:
    """Each `(parallelism, world_size, gradient_checkpointing)` of `topologies` as its own rank processes."""
    return {
        "model": MODEL,
        "global_max_length": global_max_length,
        "steps": steps,
        "runs": [
            {
                "parallelism": parallelism,
                "world_size": world_size,
                "gradient_checkpointing": checkpointing,
                "ranks": _launch(parallelism, world_size, global_max_length, steps, checkpointing),
            }
            for parallelism, world_size, checkpointing in topologies
        ],
    }


def _launch(
    parallelism: str, world_size: int, global_max_length: int, steps: int, checkpointing: bool
) -> list[dict[str, Any]]:
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="bench_memory.") as tmp:
        procs = []
        for rank in range(world_size):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(ROOT),
            }
            cmd = [
                sys.executable,
                "-m",
                "bench.bench_memory",
                "--worker",
                str(Path(tmp) / f"rank{rank}.json"),
            ]
            cmd += ["--parallelism", parallelism, "--global-max-length", str(global_max_length)]
            cmd += ["--steps", str(steps)] + (["--gradient-checkpointing"] if checkpointing else [])
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env))
        codes = [p.wait(timeout=900) for p in procs]
        if any(codes):
            raise RuntimeError(f"bench_memory ranks exited {codes} ({parallelism}, world size {world_size})")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world_size)]


def _worker(out: Path, parallelism: str, global_max_length: int, steps: int, checkpointing: bool) -> None:
    import torch
    import torch.distributed as torch_dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from stagectl.collate import collate_pack
    from stagectl.config.plan_train import LossWeights
    from stagectl.config.training import TrainingConfig
    from stagectl.data.synthetic import generate_synthetic
    from stagectl.detection.vocab import TokenVocab
    from stagectl.learner.optim import build_optimizer
    from stagectl.learner.packs import PackRunner, StepAccumulator
    from stagectl.learner.segments import SampleEncoder
    from stagectl.memory.estimate import TrainingKnobs, estimate_memory
    from stagectl.memory.from_config import model_shape
    from stagectl.models.loading import load_bundle
    from stagectl.packing import pack_segments

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if world_size > 1:
        torch_dist.init_process_group("gloo", rank=rank, world_size=world_size)
    rss_before_model = _rss_bytes("VmRSS")
    torch.manual_seed(0)
    bundle = load_bundle(MODEL)
    model = bundle.model.train()
    model.config.use_cache = False
    if checkpointing:  # as the learner enables it
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    samples = generate_synthetic(64, seed=rank, image_size=112, max_objects=4)
    encoder = SampleEncoder(bundle=bundle, samples=samples, vocab=TokenVocab.from_tokenizer(bundle.tokenizer))
    segments = [encoder.channel_a_segment(i) for i in range(len(samples))]
    group = pack_segments([len(s) for s in segments], global_max_length)[0]
    batch = collate_pack([segments[i] for i in group], model)
    num_tokens = int(batch.input_ids.numel())
    num_image_tokens = int((batch.input_ids == model.config.image_token_id).sum())
    wrapped: Any = model
    if parallelism == "fsdp":
        from stagectl.learner import sharding
        from stagectl.learner.precision import Precision

        # the learner's own sharding: fully_shard per transformer block, then the root
        sharding.shard(
            model, Precision(torch.float32, None, torch.float32, False), torch.device("cpu"), world_size
        )
    elif world_size > 1:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer, _ = build_optimizer(model, TrainingConfig(learning_rate=1e-5))
    runner = PackRunner(
        ddp_model=wrapped,
        base_model=model,
        loss_weights=LossWeights(),
        coord_token_ids=torch.tensor(bundle.coord_token_ids),
        packing_length=global_max_length,
        device=torch.device("cpu"),
    )

    def step() -> None:
        runner.run_batch(batch, scale=1.0, sync=True, acc=StepAccumulator())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # creates the optimizer state; the tracked peak is taken over the steady steps after it
    started = time.perf_counter()
    for _ in range(steps):
        step()
    tokens_per_s = num_tokens * steps / (time.perf_counter() - started)  # untracked: MemTracker slows steps
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for _ in range(steps):
            step()
            tracker.reset_mod_stats()  # per-module stats only; the global peak is kept
    peak = tracker.get_tracker_snapshot("peak")
    cpu = next(iter(peak.values()))
    knobs = TrainingKnobs(
        world_size=world_size,
        parallelism="fsdp" if parallelism == "fsdp" else "ddp",
        gradient_checkpointing=checkpointing,
        global_max_length=num_tokens,
        image_token_fraction=num_image_tokens / num_tokens,
        attention="sdpa",  # what transformers picks on CPU: a pack's block-diagonal mask per layer
    )
    estimate = estimate_memory(model_shape(MODEL), knobs)
    result = {
        "rank": rank,
        "num_tokens": num_tokens,
        "num_image_tokens": num_image_tokens,
        "tracked_peak": {k: int(cpu.get(k, 0)) for k in (*TRACKED, "Total")},
        "rss_before_model": rss_before_model,
        "peak_rss": _rss_bytes("VmHWM"),
        "tokens_per_s": tokens_per_s,
        "estimate": dict(estimate.rows()),
    }
    out.write_text(json.dumps(result, indent=2))
    if world_size > 1:
        torch_dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parallelism", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])  # `python -m bench memory`: all
    parser.add_argument("--global-max-length", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args()
    if args.worker is not None:
        _worker(
            args.worker, args.parallelism, args.global_max_length, args.steps, args.gradient_checkpointing
        )
        return
    topologies = tuple((args.parallelism, w, args.gradient_checkpointing) for w in args.world_sizes)
    result = run(topologies, args.global_max_length, args.steps)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
