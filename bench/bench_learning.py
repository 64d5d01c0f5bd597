"""The learning check: `examples/tiny/learn_shapes.yaml` trained twice at equal optimizer steps,
A-only (`b_ratio: 0`) and AB (`b_ratio: 0.25`), with greedy held-out eval (precision/recall/F1 at
IoU 0.5, valid-JSON rate) every 250 steps and at the end. The two runs train side by side, one torch
thread each (the 2 cores of the reference machine): about 14 minutes.

Run: `python -m bench learning [--max-steps N]`. `run()` returns both curves as a dict.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "examples" / "tiny" / "learn_shapes.yaml"
VARIANTS = {"A-only (b_ratio 0)": "0", "AB (b_ratio 0.25)": "0.25"}


def _command(b_ratio: str, out: Path, max_steps: int | None) -> list[str]:
    args = [sys.executable, "-m", "stagectl", "train-ab", str(CONFIG)]
    args += ["--set", f"stage2_ab.schedule.b_ratio={b_ratio}", "--set", f"training.output_dir={out}"]
    if max_steps is not None:
        args += ["--set", f"training.max_steps={max_steps}"]
        args += ["--set", f"data.eval.every_steps={max(1, max_steps // 5)}"]
    return args


def _collect(out: Path, wall: float) -> dict[str, Any]:
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    a_loss = [(r["step"], r["loss"]) for r in metrics if r["kind"] == "A"]
    return {
        "wall_s": wall,
        "steps": len(metrics),
        "b_steps": sum(r["kind"] == "B" for r in metrics),
        "eval": evals,
        "final": evals[-1],
        "a_loss_first": a_loss[0][1],
        "a_loss_last": a_loss[-1][1],
    }


def run(max_steps: int | None = None) -> dict[str, Any]:
    """Train every variant at once (one thread each) and return its eval curve and final row."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        outs = {name: Path(tmp) / f"run{k}" for k, name in enumerate(VARIANTS)}
        logs = {name: Path(tmp) / f"run{k}.log" for k, name in enumerate(VARIANTS)}
        started = time.perf_counter()
        procs = {}
        for name, ratio in VARIANTS.items():
            # the log goes to a file, not a pipe: a run's progress lines must never block on a full pipe
            with logs[name].open("w") as log:
                procs[name] = subprocess.Popen(
                    _command(ratio, outs[name], max_steps), cwd=ROOT, env=env, stdout=log, stderr=log
                )
        walls: dict[str, float] = {}
        errors: dict[str, str] = {}
        while len(walls) < len(procs):  # poll, so each run's wall time is its own
            for name, proc in procs.items():
                if name not in walls and proc.poll() is not None:
                    walls[name] = time.perf_counter() - started
                    if proc.returncode != 0:
                        errors[name] = logs[name].read_text(errors="replace")[-2000:]
            time.sleep(0.5)
        if errors:
            raise RuntimeError("learning check failed:\n" + "\n".join(f"{n}: {e}" for n, e in errors.items()))
        return {name: _collect(outs[name], walls[name]) for name in VARIANTS}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=None)
    result = run(parser.parse_args().max_steps)
    for name, r in result.items():
        final = r["final"]
        print(
            f"{name}: {r['steps']} steps ({r['b_steps']} B) in {r['wall_s']:.0f} s; final eval F1 {final['f1']:.3f} "
            f"P {final['precision']:.3f} R {final['recall']:.3f} valid JSON {final['valid_json_rate']:.2f}"
        )


if __name__ == "__main__":
    main()
