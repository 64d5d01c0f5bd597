"""The learning check: `examples/tiny/learn_shapes.yaml` trained twice at equal optimizer steps,
A-only (`b_ratio: 0`) and AB (`b_ratio: 0.25`), with greedy held-out eval (precision/recall/F1 at
IoU 0.5, valid-JSON rate) every 100 steps and at the end. Long: about 10-20 minutes on 2 CPU cores.

Run: `python -m bench.bench_learning [--max-steps N]`. `run()` returns both curves as a dict.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "examples" / "tiny" / "learn_shapes.yaml"
VARIANTS = {"A-only (b_ratio 0)": "0", "AB (b_ratio 0.25)": "0.25"}


def _train(b_ratio: str, out: Path, max_steps: int | None) -> dict[str, Any]:
    args = [sys.executable, "-m", "stagectl", "train-ab", str(CONFIG)]
    args += ["--set", f"stage2_ab.schedule.b_ratio={b_ratio}", "--set", f"training.output_dir={out}"]
    if max_steps is not None:
        args += [
            "--set",
            f"training.max_steps={max_steps}",
            "--set",
            f"data.eval.every_steps={max(1, max_steps // 5)}",
        ]
    started = time.perf_counter()
    subprocess.run(args, cwd=ROOT, check=True, capture_output=True)
    wall = time.perf_counter() - started
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
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        return {
            name: _train(ratio, Path(tmp) / f"run{k}", max_steps)
            for k, (name, ratio) in enumerate(VARIANTS.items())
        }


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
