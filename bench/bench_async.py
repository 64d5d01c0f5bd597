"""Step mode vs async mode on the same tiny workload (1 learner rank + an embedded hf rollout server,
b_ratio 0.5): wall time per optimizer step and per B step, the overlap ratio max(R, T) / W
(R = rollout busy time, T = learner busy time, W = wall time; 1.0 = perfect overlap), the learner idle
fraction, and the drop rate (dropped / produced ready packs).

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


def _config(out: Path, mode: str, max_steps: int) -> dict[str, Any]:
    return {
        "model": {"name_or_path": "builtin:tiny-qwen2.5-vl"},
        "data": {"synthetic": {"num_samples": 256, "seed": 0, "image_size": 112, "max_objects": 3}},
        "global_max_length": 1024,
        "training": {
            "per_device_train_batch_size": 4,
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
            "schedule": {"b_ratio": 0.5},
            "channel_b": {
                "mode": mode,
                "rollouts_per_step": 8,
                "rollout_decode_batch_size": 4,
                "async": {
                    "queue_limit": 8,
                    "version_window": 1,
                    "prefetch_target_packs": 4,
                    "sync_every_steps": 2,
                },
            },
        },
        "rollout_server": {"embedded": True, "max_batch_size": 8},
    }


def _train(mode: str, max_steps: int, tmp: Path) -> list[dict[str, Any]]:
    out = tmp / mode
    config = tmp / f"{mode}.yaml"
    config.write_text(yaml.safe_dump(_config(out, mode, max_steps)))
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


def _summarise(rows: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    rows = rows[2:]  # warm-up: the first steps include one-off compile/cache effects
    wall = sum(r["time/step_s"] for r in rows)
    wait = sum(r.get("time/wait_s", 0.0) for r in rows)
    b_rows = [r for r in rows if r["kind"] == "B"]
    if mode == "step":
        rollout_busy = sum(r.get("time/rollout_s", 0.0) for r in rows)
        learner_busy = wall - rollout_busy  # step mode: the learner waits for every rollout
        idle = rollout_busy
        drop_rate = 0.0
    else:
        first, last = rows[0], rows[-1]
        rollout_busy = last["stage2_ab/async/prefetch_busy_s"] - first["stage2_ab/async/prefetch_busy_s"]
        learner_busy = wall - wait
        idle = wait
        produced = last["stage2_ab/async/produced_packs_total"]
        dropped = last["stage2_ab/async/drop_stale_total"] + last["stage2_ab/async/drop_oldest_total"]
        drop_rate = dropped / produced if produced else 0.0
    return {
        "steps": len(rows),
        "b_steps": len(b_rows),
        "wall_s": wall,
        "wall_per_step_s": wall / len(rows),
        "wall_per_b_step_s": wall / max(1, len(b_rows)),
        "rollout_busy_s": rollout_busy,
        "learner_busy_s": learner_busy,
        "overlap_ratio": max(rollout_busy, learner_busy) / wall if wall else 0.0,
        "learner_idle_fraction": idle / wall if wall else 0.0,
        "drop_rate": drop_rate,
        "b_ratio_realized": len(b_rows) / len(rows),
    }


def run(max_steps: int = 18) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        step = _summarise(_train("step", max_steps, Path(tmp)), "step")
        async_ = _summarise(_train("async", max_steps, Path(tmp)), "async")
    return {
        "step": step,
        "async": async_,
        "speedup_wall_per_step": step["wall_per_step_s"] / async_["wall_per_step_s"],
    }


def main() -> None:
    result = run()
    for mode in ("step", "async"):
        print(mode, {k: round(v, 3) if isinstance(v, float) else v for k, v in result[mode].items()})
    print(f"wall per optimizer step, step / async: {result['speedup_wall_per_step']:.2f}x")


if __name__ == "__main__":
    main()
