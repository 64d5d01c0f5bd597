"""The learning check's jobs: the run sizes, how a run is launched and how runs are scheduled, shared by the
1-core phase (`bench/bench_learning.py`) and the separated phase (`bench/learning_separated.py`), which the
first one calls: a leaf, so the two never import each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[1]
A_ONLY_FACTOR = 2  # A-only phase-2 runs this many times the steps (for the equal-wall-time comparison)


# Channel-B variants screened (one seed, `SCREEN_B_RATIO`, every task), each the overrides beside b_ratio;
# the best two by class-aware AP go on to the b_ratio sweep (`SWEEP_B_RATIOS`, `sizes.seeds` seeds).
AB_VARIANTS: dict[str, list[str]] = {
    "raw_prefix": ["stage2_ab.channel_b.target=raw_prefix"],
    "clean_prefix": ["stage2_ab.channel_b.target=clean_prefix"],
    "clean_prefix desc_matched": [
        "stage2_ab.channel_b.target=clean_prefix",
        "stage2_ab.channel_b.desc_ce_weight_matched=1.0",
    ],
    "reordered_gt desc_matched": [
        "stage2_ab.channel_b.target=reordered_gt",
        "stage2_ab.channel_b.desc_ce_weight_matched=1.0",
    ],
    "reordered_gt desc_matched unmasked": [
        "stage2_ab.channel_b.target=reordered_gt",
        "stage2_ab.channel_b.desc_ce_weight_matched=1.0",
        "stage2_ab.channel_b.mask_correct_matched_desc=false",
    ],
    "clean_prefix greedy_iou desc_gated": [
        "stage2_ab.channel_b.target=clean_prefix",
        "stage2_ab.channel_b.match.assignment=greedy_iou",
        "stage2_ab.channel_b.match.desc_gated=true",
    ],
}


def slug(variant: str) -> str:
    """A variant's name in run dir names (`bench.bench_learning.run_name`)."""
    return variant.replace(" ", "_")


@dataclass(frozen=True)
class Sizes:
    tasks: tuple[str, ...]
    stage1_steps: dict[str, int]
    phase2_steps: int
    seeds: int
    eval_images: dict[str, int]
    train_images: int = 4096
    phase2_lr: float = 1.0e-4  # Stage-1's final LR (cosine from 1e-3 to min_lr_ratio 0.1)


@dataclass
class Job:
    name: str
    argv: list[str]
    out: Path
    after: str | None = None  # the job whose output this one needs (phase 2 after its task's Stage-1)


def run_finished(run_dir: Path) -> bool:
    """A run that trained every step it was asked for. A run an error ended or a signal stopped writes
    final_state.json too (with `error` / `stopped_by_signal`): it is no result, and a check re-run on the same
    --out runs it again."""
    path = run_dir / "final_state.json"
    if not path.is_file():
        return False
    state = json.loads(path.read_text())
    return (
        not state.get("error")
        and state.get("stopped_by_signal") is None
        and state.get("global_step", -1) >= state.get("max_steps", 0)
    )


def train_argv(config: Path, out: Path, overrides: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "stagectl", "train-ab", str(config), "--set", f"training.output_dir={out}"]
    for item in overrides:
        argv += ["--set", item]
    return argv


def run_jobs(jobs: list[Job], workers: int, log_dir: Path) -> dict[str, float]:
    """Run `jobs`, `workers` at a time, one torch thread each, each once the job it needs has finished
    (in list order otherwise), a run left unfinished by an earlier check started again (`--overwrite`: train-ab
    moves it aside); returns each job's wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    pending = list(jobs)
    names = {job.name for job in jobs}  # a job needed but not in the list (a reused Stage-1) is done
    running: dict[str, tuple[subprocess.Popen[bytes], float, Path]] = {}
    walls: dict[str, float] = {}
    while pending or running:
        while len(running) < workers:
            ready = [j for j in pending if j.after is None or j.after in walls or j.after not in names]
            if not ready:
                break
            job = ready[0]
            pending.remove(job)
            log = log_dir / f"{job.name}.log"
            # a run an earlier check left unfinished (killed, failed or stopped): train-ab moves it aside, starts again
            stopped = job.out.exists() and not run_finished(job.out)
            argv = [*job.argv, "--overwrite"] if stopped else job.argv
            # the log goes to a file, not a pipe: a run's progress lines must never block on a full pipe
            with log.open("w") as handle:
                proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=handle, stderr=handle)
            running[job.name] = (proc, time.perf_counter(), log)
            print(
                f"   started {job.name}" + (" (its unfinished run moved aside)" if stopped else ""),
                flush=True,
            )
        for name, (proc, started, log) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            if proc.returncode != 0:
                for other, _, _ in running.values():
                    other.kill()
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"learning check: {name} failed (exit {proc.returncode}):\n{tail}")
            walls[name] = time.perf_counter() - started
            print(f"   finished {name} in {walls[name]:.0f} s", flush=True)
        time.sleep(0.5)
    return walls


def phase2_overrides(checkpoint: Path, steps: int, seed: int, sizes: Sizes) -> list[str]:
    """What every phase-2 run sets: start from the Stage-1 checkpoint, constant LR, eval every
    `phase2_steps / 2` steps (the same steps for every variant, whatever its length)."""
    return [
        f"model.name_or_path={checkpoint}",
        f"training.max_steps={steps}",
        f"training.seed={seed}",
        f"training.learning_rate={sizes.phase2_lr}",
        "training.lr_scheduler_type=constant",
        "training.warmup_steps=10" if sizes.phase2_steps > 20 else "training.warmup_steps=0",
        f"data.eval.every_steps={max(1, sizes.phase2_steps // 2)}",
        "training.save_steps=0",
        "training.save_total_limit=1",
    ]
