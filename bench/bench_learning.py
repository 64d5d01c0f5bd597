"""The learning check, as Stage-2 is used: Stage-1 (A-only) to a checkpoint, then from that checkpoint
A-only and the Channel-B variants (`AB_VARIANTS`): a screen of every variant at `SCREEN_B_RATIO` (seed 0),
then a confirmation of the best two with every seed, over `SWEEP_B_RATIOS` on `SWEEP_TASKS`; held-out
class-aware and class-agnostic AP, desc accuracy, F1 box / F1 desc, precision / recall / invalid-rollout rate /
duplicate rate with 95% intervals at equal optimizer steps and at equal training wall time, plus the F1 curves.

Tasks (`examples/tiny/learn_shapes.yaml`, the tiny Qwen3-VL; `TASKS`):
- sparse: 1-2 shapes of 30-50% of the side of a 112 px image (the seed check's task);
- dense: 1-4 shapes of 30-40% of the side of a 112 px image: more, smaller objects, colours repeating within
  an image (4 colours), longer answers, where missed objects and exposure bias matter. Sizes the tiny model
  learns on 2 cores: 1-4 shapes of 25-35% left held-out F1 at 0.09 after 2,500 Stage-1 steps (it learnt
  colours and counts, not positions), 1-6 of 20-30% at 0.05-0.08 after 800; 1-4 of 30-40% reached 0.49 at
  1,000 steps and 1-3 of 30-40% 0.76 at 1,500 (probe runs, 128 eval images);
- crowded: 4-8 shapes of 20-30% of the side of a 168 px image, where Stage-1 misses objects (its Stage-1
  checkpoint does not localise them: recall 0.16 in the 2026-11-29 check; phase 2 runs on it all the same).

Stage-1 runs 2,500 steps (1,500 on crowded; cosine from lr 1e-3 to 1e-4), phase 2 200 steps at a constant
1e-4, Stage-1's final LR (A-only to 400 for the equal-wall-time point); one A-only run at the old phase-2 LR
(`OLD_PHASE2_LR`, 3e-4) shows the protocol before issue 40.

How it fits 2 cores (54 min for the recorded run, with other work on the machine): every run is its own
`stagectl train-ab` process with one torch thread,
`--jobs` (2) at a time; Stage-1 of the tasks runs side by side; phase 2 uses a constant learning rate so
an A-only run of `A_ONLY_FACTOR` x the steps gives both the equal-step point (at `phase2_steps`) and the
equal-wall-time point (the A-only eval whose cumulative training time is closest to AB's, because a B
step costs more than an A step here); evals every `phase2_steps / 2` steps on a held-out set sized so
the 95% interval of F1 is about +-0.03 or tighter (checked and printed: `f1_half_width`).

Intervals: `stagectl.report.intervals` (bootstrap over seeds, then over held-out images, paired on images
across variants, 2,000 draws; AP by `stagectl.report.ap_intervals` on 200 draws); the same code serves
`stagectl report RUN_DIR RUN_DIR ...`.

Separated phase (issue #26, `bench/learning_separated.py`): after the 1-core runs, from the same Stage-1
checkpoints, one run at a time on the process's first two CPUs: async AB with the learner and an embedded
rollout server on separate cores vs A-only with the learner on both; its own sub-section in BENCHMARKS.md.

Run: `python -m bench learning` (full: Stage-1, the 1-core runs, the separated phase),
`python -m bench.bench_learning --separated-only --out DIR` (Stage-1 unless DIR holds it finished, then only
the separated phase, merged into bench/results/learning.json and BENCHMARKS.md), or `--quick` with either
(the same code for a few steps: plumbing only, nothing saved; `--quick` alone skips the separated phase).
`run()` returns everything BENCHMARKS.md shows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from bench.learning_jobs import (
    A_ONLY_FACTOR,
    AB_VARIANTS,
    ROOT,
    Job,
    Sizes,
    phase2_overrides,
    run_finished,
    run_jobs,
    slug,
    train_argv,
)

CONFIG = ROOT / "examples" / "tiny" / "learn_shapes.yaml"

TASKS: dict[str, dict[str, Any]] = {
    "sparse": {"image_size": 112, "max_objects": 2, "side_fraction": [0.3, 0.5], "max_new_tokens": 128},
    "dense": {"image_size": 112, "max_objects": 4, "side_fraction": [0.3, 0.4], "max_new_tokens": 192},
    # 4-8 shapes per image (a crowded image places fewer: 4-5 mostly), where Stage-1 misses objects
    "crowded": {
        "image_size": 168,
        "min_objects": 4,
        "max_objects": 8,
        "side_fraction": [0.2, 0.3],
        "max_new_tokens": 320,
    },
}
SCREEN_B_RATIO = 0.25
SWEEP_B_RATIOS = (0.05, 0.1, 0.25, 0.5)
# the b_ratio sweep runs on these tasks; the others confirm the best two at SCREEN_B_RATIO with every seed
SWEEP_TASKS = ("sparse",)
# the separated phase (async AB on separate cores vs A-only on both: the equal-training-time headline)
SEPARATED_TASKS = ("sparse", "dense")
# `--quick` (the test tier's plumbing run): two variants, one b_ratio, no protocol run
QUICK_VARIANTS = ("raw_prefix", "reordered_gt desc_matched")
OLD_PHASE2_LR = 3.0e-4  # the protocol before issue 40 (A-only fell below Stage-1): one A-only run to show it


FULL = Sizes(
    ("sparse", "dense", "crowded"),
    stage1_steps={"sparse": 2500, "dense": 2500, "crowded": 1500},
    phase2_steps=200,
    seeds=3,
    eval_images={"sparse": 400, "dense": 512, "crowded": 256},
)
# the test tier's plumbing run: the same code on one task, one seed, a few steps and a small data set
# (drawing 4096 images is most of a cold start)
QUICK = Sizes(
    ("sparse",),
    stage1_steps={"sparse": 2},
    phase2_steps=2,
    seeds=1,
    eval_images={"sparse": 4},
    train_images=32,
)


def _task_config(task: str, sizes: Sizes, path: Path) -> Path:
    """The learning config with the task's data and eval split."""
    config = yaml.safe_load(CONFIG.read_text())
    spec = TASKS[task]
    shapes = {k: spec[k] for k in ("image_size", "min_objects", "max_objects", "side_fraction") if k in spec}
    config["data"]["synthetic"].update(shapes, num_samples=sizes.train_images)
    n_eval = sizes.eval_images[task]
    config["data"]["eval"] = {
        "synthetic": {"num_samples": n_eval, "seed": 1, **shapes},
        "max_samples": n_eval,
        "every_steps": 0,
    }
    config["custom"]["extra"]["rollout_matching"]["max_new_tokens"] = spec["max_new_tokens"]
    # every variant is its AB_VARIANTS overrides on the defaults: the example's own Channel-B target and its
    # knobs (its recommendation) must not leak into the variants that do not name them
    channel_b = config["stage2_ab"]["channel_b"]
    for key in ("target", "desc_ce_weight_matched", "mask_correct_matched_desc", "match", "insertion_order"):
        channel_b.pop(key, None)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_name(task: str, variant: str, b_ratio: float, seed: int) -> str:
    """`{task}-A-only-seed{k}` or `{task}-{variant}-b{ratio}-seed{k}` (the analysis groups runs by it)."""
    if variant == "A-only":
        return f"{task}-A-only-seed{seed}"
    return f"{task}-{slug(variant)}-b{b_ratio:g}-seed{seed}"


def _job(
    task: str,
    variant: str,
    b_ratio: float,
    seed: int,
    config: Path,
    checkpoint: Path,
    sizes: Sizes,
    out: Path,
) -> Job:
    a_only = variant == "A-only"
    steps = sizes.phase2_steps * (A_ONLY_FACTOR if a_only else 1)
    name = run_name(task, variant, b_ratio, seed)
    overrides = [f"stage2_ab.schedule.b_ratio={0 if a_only else b_ratio}", *AB_VARIANTS.get(variant, [])]
    argv = train_argv(config, out / name, [*phase2_overrides(checkpoint, steps, seed, sizes), *overrides])
    return Job(name, argv, out / name, after=f"{task}-stage1")


def screen_jobs(
    task: str,
    config: Path,
    checkpoint: Path,
    sizes: Sizes,
    out: Path,
    variants: tuple[str, ...] = tuple(AB_VARIANTS),
    protocol: bool = True,
) -> list[Job]:
    """Seed 0: A-only and every AB variant at `SCREEN_B_RATIO`; on the first sweep task also A-only at the
    old phase-2 LR (`protocol`: does A-only fall below the Stage-1 checkpoint?)."""
    jobs = [_job(task, v, SCREEN_B_RATIO, 0, config, checkpoint, sizes, out) for v in ["A-only", *variants]]
    if protocol and task == SWEEP_TASKS[0]:
        old = Sizes(**{**asdict(sizes), "phase2_lr": OLD_PHASE2_LR})
        name = f"{task}-A-only_lr{OLD_PHASE2_LR:g}-seed0"
        argv = train_argv(
            config,
            out / name,
            [*phase2_overrides(checkpoint, sizes.phase2_steps, 0, old), "stage2_ab.schedule.b_ratio=0"],
        )
        jobs.append(Job(name, argv, out / name, after=f"{task}-stage1"))
    return jobs


def confirm_jobs(
    task: str,
    best: list[str],
    config: Path,
    checkpoint: Path,
    sizes: Sizes,
    out: Path,
    sweep: tuple[float, ...] = SWEEP_B_RATIOS,
) -> list[Job]:
    """Every seed of A-only and of the `best` variants, over `sweep` on the sweep tasks and at
    `SCREEN_B_RATIO` elsewhere (runs already finished, the screen's among them, are not run again)."""
    ratios = sweep if task in SWEEP_TASKS else (SCREEN_B_RATIO,)
    jobs = [_job(task, "A-only", 0, seed, config, checkpoint, sizes, out) for seed in range(sizes.seeds)]
    for seed in range(sizes.seeds):
        for variant in best:
            jobs += [_job(task, variant, b, seed, config, checkpoint, sizes, out) for b in ratios]
    return [job for job in jobs if not run_finished(job.out)]


def screen_ap(out: Path, task: str, sizes: Sizes) -> dict[str, float]:
    """Class-aware AP at `phase2_steps` of each screened variant's seed-0 run (A-only included)."""
    found = {}
    for variant in ["A-only", *AB_VARIANTS]:
        path = out / run_name(task, variant, SCREEN_B_RATIO, 0) / "eval.jsonl"
        if path.is_file():
            rows = {int(r["step"]): r for r in map(json.loads, path.read_text().splitlines())}
            if sizes.phase2_steps in rows:
                found[variant] = float(rows[sizes.phase2_steps]["AP"])
    return found


def best_two(out: Path, sizes: Sizes) -> tuple[list[str], dict[str, float]]:
    """The two AB variants with the largest mean (over tasks) class-aware AP difference to A-only in the
    screen, and every variant's mean difference."""
    deltas: dict[str, list[float]] = {}
    for task in sizes.tasks:
        ap = screen_ap(out, task, sizes)
        if "A-only" not in ap:
            continue
        for variant in AB_VARIANTS:
            if variant in ap:
                deltas.setdefault(variant, []).append(ap[variant] - ap["A-only"])
    mean = {v: sum(d) / len(d) for v, d in deltas.items()}
    return sorted(mean, key=lambda v: -mean[v])[:2], mean


def _samples(run_dirs: list[Path], step: int) -> dict[str, list[dict[str, Any]]]:
    """The first greedy rollouts of each variant's seed-0 run at `step` (from `eval_samples.jsonl`)."""
    out = {}
    for path in run_dirs:
        if not path.name.endswith("seed0"):
            continue
        rows = [json.loads(line) for line in (path / "eval_samples.jsonl").read_text().splitlines()]
        out[path.name] = [r for r in rows if r["step"] == step][:2]
    return out


def analyse(out: Path, quick: bool = False) -> dict[str, Any]:
    """The report of the finished runs under `out` (also after a check that was stopped early)."""
    from bench import learning_analysis

    sizes = QUICK if quick else FULL
    tasks = {}
    for task in sizes.tasks:
        if not _stage1_done(out / f"{task}-stage1", _checkpoint(out, task, sizes)):
            continue
        learning_analysis.ensure_stage1_eval(out, task, out / f"{task}.yaml", _checkpoint(out, task, sizes))
        result = learning_analysis.analyse_task(out, task, sizes.phase2_steps, SCREEN_B_RATIO)
        if result is not None:
            result["samples"] = _samples(sorted(out.glob(f"{task}-*-seed0")), sizes.phase2_steps)
            tasks[task] = learning_analysis.as_json(result)
    return tasks


def wall_deltas(out: Path, task: str, phase2_steps: int) -> dict[tuple[str, float], float]:
    from bench import learning_analysis

    return learning_analysis.wall_deltas(out, task, phase2_steps)


def reading(tasks: dict[str, Any]) -> list[str]:
    from bench import learning_analysis

    return learning_analysis.overall_reading(tasks)


def _checkpoint(out: Path, task: str, sizes: Sizes) -> Path:
    return out / f"{task}-stage1" / f"checkpoint-{sizes.stage1_steps[task]}" / "model"


def run(
    quick: bool = False,
    out_dir: Path | None = None,
    workers: int = 2,
    one_core: bool = True,
    separated: bool | None = None,
    only_tasks: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Run the check and return its tables, intervals and curves: Stage-1, the 1-core phase-2 variants
    (`one_core`), then the separated phase (`separated`; default: at full size, not in `--quick`, whose
    plumbing test keeps its budget). Without the 1-core phase, Stage-1 checkpoints already finished under
    `out_dir` are reused."""
    from bench import learning_separated

    sizes = QUICK if quick else FULL
    if only_tasks:
        sizes = Sizes(**{**asdict(sizes), "tasks": tuple(only_tasks)})
    with_separated = not quick if separated is None else separated
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        out = out_dir if out_dir is not None else Path(tmp)
        if with_separated:
            learning_separated.refuse_existing(out, sizes)
        logs = out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        configs = {task: _task_config(task, sizes, out / f"{task}.yaml") for task in sizes.tasks}
        checkpoints = {
            task: out / f"{task}-stage1" / f"checkpoint-{sizes.stage1_steps[task]}" / "model"
            for task in sizes.tasks
        }
        stage1 = {
            task: Job(
                f"{task}-stage1",
                train_argv(
                    configs[task],
                    out / f"{task}-stage1",
                    [
                        "stage2_ab.schedule.b_ratio=0",
                        f"training.max_steps={sizes.stage1_steps[task]}",
                        "training.save_steps=0",
                        "training.save_total_limit=1",
                    ],
                ),
                out / f"{task}-stage1",
            )
            for task in sizes.tasks
            if not _stage1_done(out / f"{task}-stage1", checkpoints[task])
        }
        for task in sorted(set(sizes.tasks) - set(stage1)):
            print(f"   reusing {checkpoints[task]}", flush=True)
        walls: dict[str, float] = {}
        stage1_walls: dict[str, float] = {}
        selection: dict[str, Any] = {}
        if one_core:
            # Stage-1 of every task first; then the screen, the tasks interleaved (each task's runs as soon
            # as its Stage-1 is done, so the workers stay busy with similar loads); then the best two
            # variants over the b_ratio sweep and every seed
            variants = QUICK_VARIANTS if quick else tuple(AB_VARIANTS)
            screen = [
                screen_jobs(t, configs[t], checkpoints[t], sizes, out, variants, protocol=not quick)
                for t in sizes.tasks
            ]
            walls = run_jobs([*stage1.values(), *_unfinished(_interleave(screen))], workers, logs)
            stage1_walls = {job.name: walls.pop(job.name) for job in stage1.values()}
            best, screen_delta = best_two(out, sizes)
            selection = {"best_two": best, "screen_delta_ap": screen_delta}
            print(f"   screen: mean ΔAP vs A-only {screen_delta}; confirming {best}", flush=True)
            sweep = (SCREEN_B_RATIO,) if quick else SWEEP_B_RATIOS
            confirm = [
                confirm_jobs(t, best, configs[t], checkpoints[t], sizes, out, sweep) for t in sizes.tasks
            ]
            walls.update(run_jobs(_interleave(confirm), workers, logs))
        else:
            stage1_walls = run_jobs(list(stage1.values()), workers, logs)
        tasks = analyse(out, quick) if one_core else {}
        extra: dict[str, Any] = {}
        if with_separated:
            arm = learning_separated.choose_arm_from(
                {t: wall_deltas(out, t, sizes.phase2_steps) for t in sizes.tasks}
            )
            print(f"   separated phase: {arm[0]} at b_ratio {arm[1]:g}", flush=True)
            part = learning_separated.run_phase(
                configs,
                checkpoints,
                sizes,
                out,
                logs,
                arm=arm,
                tasks=tuple(t for t in SEPARATED_TASKS if t in sizes.tasks),
            )
            part.update(
                ran_at=time.strftime("%Y-%m-%d %H:%M:%S"),
                stage1_reused=sorted(set(sizes.tasks) - set(stage1)),
                stage1_wall_s=stage1_walls,
                total_s=time.perf_counter() - started,  # this invocation's, Stage-1 and 1-core phase included
            )
            extra["separated"] = part
    total_s = time.perf_counter() - started
    print(f"   learning check: {total_s:.0f} s in all", flush=True)
    return _result(
        sizes,
        workers,
        total_s,
        tasks,
        quick=quick,
        stage1_wall_s=stage1_walls,
        phase2_wall_s=walls,
        selection=selection,
        **extra,
    )


def _interleave(per_task: list[list[Job]]) -> list[Job]:
    return [job for group in itertools.zip_longest(*per_task) for job in group if job is not None]


def _unfinished(jobs: list[Job]) -> list[Job]:
    """Jobs whose run has not finished (a check re-run on the same `--out` goes on where it stopped)."""
    return [job for job in jobs if not run_finished(job.out)]


def _stage1_done(run_dir: Path, checkpoint: Path) -> bool:
    """A finished Stage-1 run: its final state, checkpoint and held-out eval are all there."""
    return run_finished(run_dir) and checkpoint.is_dir() and (run_dir / "eval.jsonl").is_file()


def _result(
    sizes: Sizes, workers: int, total_s: float, tasks: Any, *, quick: bool = False, **walls: Any
) -> dict[str, Any]:
    """What `run()` and `report_only()` return (the learning section of BENCHMARKS.md reads it)."""
    return {
        "screen_b_ratio": SCREEN_B_RATIO,
        "sweep_b_ratios": list(SWEEP_B_RATIOS),
        "sweep_tasks": list(SWEEP_TASKS),
        "reading": reading(tasks),
        "quick": quick,
        "sizes": asdict(sizes),
        "a_only_factor": A_ONLY_FACTOR,
        "workers": workers,
        "tasks_spec": {task: TASKS[task] for task in sizes.tasks},
        **walls,
        "total_s": total_s,
        "tasks": tasks,
    }


def report_only(out: Path, workers: int = 2) -> dict[str, Any]:
    """`run()`'s result from the runs already under `out` (a check stopped early, or re-analysed); the wall
    time is from the first config written to the last run finished."""
    from bench import learning_separated

    sizes = FULL
    configs = [out / f"{task}.yaml" for task in sizes.tasks]
    finals = [p for p in out.glob("*/final_state.json") if not p.parent.name.startswith("sep-")]
    total = (
        max(p.stat().st_mtime for p in finals) - min(p.stat().st_mtime for p in configs) if finals else 0.0
    )
    best, screen_delta = best_two(out, sizes)
    selection = {"best_two": best, "screen_delta_ap": screen_delta}
    result = _result(sizes, workers, total, analyse(out), selection=selection)
    separated = learning_separated.reanalyse(out, sizes)
    if separated is not None:
        result["separated"] = separated
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few steps: plumbing only (nothing saved)")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each)")
    parser.add_argument(
        "--separated-only",
        action="store_true",
        help="Stage-1 (reused when --out holds it finished) and the separated phase only; at full size the "
        "result is merged into bench/results/learning.json and BENCHMARKS.md",
    )
    parser.add_argument(
        "--no-separated",
        action="store_true",
        help="Stage-1, the screen and the sweep only (no separated phase)",
    )
    parser.add_argument("--tasks", nargs="+", default=None, help=f"these tasks only (of {', '.join(TASKS)})")
    args = parser.parse_args()
    if args.no_separated:
        result = run(args.quick, args.out, args.jobs, separated=False, only_tasks=args.tasks)
    elif args.separated_only:
        result = run(args.quick, args.out, args.jobs, one_core=False, separated=True)
    else:
        result = run(args.quick, args.out, args.jobs)
    print("\n".join(result["reading"]))
    for task, r in result.get("separated", {}).get("tasks", {}).items():
        print(f"== {task}, separated placement: step {r['step']}, training s {r['train_s']}")
        print("\n".join([*r["table"], *r["equal_wall"]["table"][2:]]))
        print(f"overlap: {r['overlap']}")
    if args.separated_only and not args.quick:
        from bench.learning_separated import save

        print(f"merged into {save(result)}")
    print(f"total {result['total_s']:.0f} s")


if __name__ == "__main__":
    main()
