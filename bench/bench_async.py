"""Async Channel-B on the tiny workload (1 learner rank + an embedded hf rollout server, one intra-op
thread each), next to step mode:

- `step`: step mode, b_ratio 0.5, GAS 2, 8 rollouts per B step (the baseline);
- `async_bs1`: async, packing (a micro-batch is one sequence of up to 2048 tokens), b_ratio 0.5,
  sync every 2 steps;
- `async_bs2`: async, `packing: false` with 2 padded samples per micro-batch, otherwise the same;
- `async_bs1_sync1`: async, packing, B only, sync every step, queue 3, target 2 — the configuration
  whose old pacing threw away three rollouts of four.

Per run: wall time per step, the overlap ratio max(R, T) / W (R = rollout busy time, T = learner busy
time, W = wall time; 1.0 = perfect overlap), the learner idle fraction, the realised B ratio, the fill of
the B micro-batches, and the rollout drop rate (rollouts generated and never trained / generated), over
the whole run and in steady state (after the first 4 steps, before the last 2).

Run: `python -m bench.bench_async`. `run()` returns the numbers as a dict.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parents[1]
WARMUP, TAIL = 4, 2


def _config(out: Path, name: str, max_steps: int) -> dict[str, Any]:
    sync1 = name == "async_bs1_sync1"
    padded = name == "async_bs2"
    return {
        "model": {"name_or_path": "builtin:tiny-qwen2.5-vl"},
        "data": {"synthetic": {"num_samples": 256, "seed": 0, "image_size": 112, "max_objects": 3}},
        "global_max_length": 2048,
        "training": {
            "packing": not padded,
            "per_device_train_batch_size": 2 if padded else 1,
            "gradient_accumulation_steps": 2,
            "learning_rate": 1e-3,
            "max_steps": max_steps,
            "output_dir": str(out),
        },
        "custom": {
            "extra": {
                "rollout_matching": {
                    "rollout_backend": "vllm",
                    "max_new_tokens": 48,
                    "vllm": {"mode": "server", "sync": {"mode": "full", "transport": "http"}},
                }
            }
        },
        "stage2_ab": {
            "schedule": {"b_ratio": 1.0 if sync1 else 0.5},
            "channel_b": {
                "mode": "step" if name == "step" else "async",
                "rollouts_per_step": 8,
                "rollout_decode_batch_size": 8 if sync1 else 4,
                "async": {
                    "queue_limit": 3 if sync1 else 8,
                    "version_window": 1,
                    "prefetch_target_packs": 2 if sync1 else 4,
                    "sync_every_steps": 1 if sync1 else 2,
                },
            },
        },
        "rollout_server": {"embedded": True, "max_batch_size": 8},
    }


def _train(name: str, max_steps: int, tmp: Path) -> list[dict[str, Any]]:
    out = tmp / name
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump(_config(out, name, max_steps)))
    # one intra-op thread for the learner and the server alike: on 2 shared cores, oversubscribed torch
    # threads make step times swing by 10x and would decide the comparison
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "stagectl", "train-ab", str(config)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env=env,
    )
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _drop_rate(first: dict[str, Any], last: dict[str, Any]) -> float:
    key = "stage2_ab/async/rollouts_"
    requested = last[key + "requested_total"] - first[key + "requested_total"]
    dropped = last[key + "dropped_total"] - first[key + "dropped_total"]
    return dropped / requested if requested else 0.0


def _summarise(all_rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    rows = all_rows[2:]  # warm-up: the first steps include one-off compile/cache effects
    wall = sum(r["time/step_s"] for r in rows)
    b_rows = [r for r in rows if r["kind"] == "B"]
    out: dict[str, Any] = {
        "steps": len(rows),
        "b_steps": len(b_rows),
        "wall_per_step_s": wall / len(rows),
        "trained_tokens_per_s": sum(r["tokens"] for r in rows) / wall if wall else 0.0,
        "b_ratio_realized": len(b_rows) / len(rows),
        "b_fill": sum(r["packing/fill"] for r in b_rows) / max(1, len(b_rows)),
    }
    if name == "step":
        rollout_busy = sum(r.get("time/rollout_s", 0.0) for r in rows)
        learner_busy = wall - rollout_busy  # step mode: the learner waits for every rollout
        idle = rollout_busy
        out.update(drop_rate=0.0, drop_rate_steady=0.0)
    else:
        last = all_rows[-1]
        wait = sum(r.get("time/wait_s", 0.0) + r.get("time/weight_sync_s", 0.0) for r in rows)
        rollout_busy = (
            rows[-1]["stage2_ab/async/prefetch_busy_s"] - rows[0]["stage2_ab/async/prefetch_busy_s"]
        )
        learner_busy = wall - wait
        idle = wait
        steady = all_rows[WARMUP : len(all_rows) - TAIL]
        out.update(
            drop_rate=last["stage2_ab/async/drop_rate"],
            drop_rate_steady=_drop_rate(steady[0], steady[-1]),
            rollouts_requested=last["stage2_ab/async/rollouts_requested_total"],
            rollouts_trained=last["stage2_ab/async/rollouts_trained_total"],
            drop_oldest=last["stage2_ab/async/drop_oldest_total"],
            drop_stale=last["stage2_ab/async/drop_stale_total"],
        )
    out.update(
        rollout_busy_s=rollout_busy,
        learner_busy_s=learner_busy,
        overlap_ratio=max(rollout_busy, learner_busy) / wall if wall else 0.0,
        learner_idle_fraction=idle / wall if wall else 0.0,
    )
    return out


RUNS = ("step", "async_bs1", "async_bs2", "async_bs1_sync1")


def run(max_steps: int = 18) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        results = {name: _summarise(_train(name, max_steps, Path(tmp)), name) for name in RUNS}
    results["speedup_wall_per_step"] = (
        results["step"]["wall_per_step_s"] / results["async_bs1"]["wall_per_step_s"]
    )
    results["speedup_tokens_per_s"] = (
        results["async_bs1"]["trained_tokens_per_s"] / results["step"]["trained_tokens_per_s"]
    )
    return results


def main() -> None:
    result = run()
    for name in RUNS:
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in result[name].items()})
    print(f"wall per optimizer step, step / async (bs 1): {result['speedup_wall_per_step']:.2f}x")


if __name__ == "__main__":
    main()
