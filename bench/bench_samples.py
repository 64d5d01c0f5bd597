"""The cost of the per-sample audit trail (`samples.jsonl`), two ways, on the same tiny workload:

- end to end: train-ab steps/s with it (the product) and without it (the learner's per-step gather + write
  replaced by a no-op through `bench/samples_hook/`, a bench-only hook), runs interleaved;
- in the run: the same hook times every call of the gather + write on each rank of the "with" runs; per
  step the smaller of the ranks' times (the rank that arrives last at the gather waits least, so its time
  is the cost itself, not the other rank's lateness), as a share of the median step time of that run.
  This share does not move with the machine's load the way two separate runs do.

Workload: 2 learner ranks (torchrun, gloo), one intra-op thread each (`OMP_NUM_THREADS=1`), the tiny
model, Channel-A only with packing (the fastest steps, so the largest relative overhead), GAS 2.
Steps/s per run: 1 / the median `time/step_s` of the steps after the first `WARMUP` (rank 0's whole
step, the gather and the write included; the median, because other work on the machine comes in bursts).

Run: `python -m bench samples`. `run()` returns the numbers as a dict.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parents[1]
HOOK = Path(__file__).parent / "samples_hook"
MAX_STEPS, WARMUP, REPEATS = 40, 5, 3


def _config(out: Path) -> dict[str, Any]:
    return {
        "model": {"name_or_path": "builtin:tiny-qwen2.5-vl"},
        "data": {"synthetic": {"num_samples": 256, "seed": 0, "image_size": 112, "max_objects": 3}},
        "global_max_length": 1024,
        "training": {
            "per_device_train_batch_size": 1,
            "gradient_accumulation_steps": 2,
            "learning_rate": 1e-3,
            "max_steps": MAX_STEPS,
            "output_dir": str(out),
        },
        "launch": {"nproc_per_node": 2},
        "stage2_ab": {"schedule": {"b_ratio": 0.0}},
    }


def _steps_per_s(with_samples: bool, tmp: Path, k: int) -> tuple[float, int, float]:
    name = f"{'with' if with_samples else 'without'}-{k}"
    out = tmp / name
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump(_config(out)))
    timings = tmp / f"{name}-timings"
    timings.mkdir()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HOOK), str(ROOT)]),
        "STAGECTL_BENCH_SAMPLES": f"time:{timings}" if with_samples else "off",
    }
    done = subprocess.run(
        [sys.executable, "-m", "stagectl", "train-ab", str(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    median_step_s = statistics.median(r["time/step_s"] for r in rows[WARMUP:])
    lines = (out / "samples.jsonl").read_text().count("\n") if (out / "samples.jsonl").exists() else 0
    share = 0.0
    if with_samples:
        per_rank = [[float(x) for x in (timings / f"rank{r}.txt").read_text().split()] for r in (0, 1)]
        cost_s = [min(pair) for pair in zip(*per_rank, strict=True)][WARMUP:]
        share = statistics.median(cost_s) / median_step_s
    return 1.0 / median_step_s, lines, share


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-samples-") as tmp_dir:
        tmp = Path(tmp_dir)
        with_s, without_s, lines, shares = [], [], [], []
        for k in range(REPEATS):  # interleaved: load drift hits both sides alike
            rate, num_lines, share = _steps_per_s(True, tmp, k)
            with_s.append(rate)
            lines.append(num_lines)
            shares.append(share)
            rate, num_lines, _ = _steps_per_s(False, tmp, k)
            assert num_lines == 0, "the no-op hook did not take"
            without_s.append(rate)
    ratios = [w / wo for w, wo in zip(with_s, without_s, strict=True)]
    return {
        "max_steps": MAX_STEPS,
        "warmup": WARMUP,
        "with_steps_per_s": with_s,
        "without_steps_per_s": without_s,
        "pair_ratios": ratios,
        "ratio_median": statistics.median(with_s) / statistics.median(without_s),
        "lines_per_run": lines,
        "in_run_cost_share": shares,
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
