"""The learning check's separated phase (issue #26): async AB with the learner and the rollout server on
separate cores, against A-only given the same two cores, from the same Stage-1 checkpoints.

Per task and seed, one run at a time (each run owns both cores):
- `AB async separated`: the arm the 1-core confirmation chose (`choose_arm`: the (variant, b_ratio) group
  with the best mean class-aware ΔAP vs A-only at equal training time over the tasks), Channel-B in async
  mode from an embedded hf rollout server (server rollouts: `rollout_backend: vllm`, `vllm.mode: server`,
  full weight sync over http after every step); the learner pinned to core A, the server to core B, the
  prefetcher thread on the server's core; `phase2_steps` steps;
- `A-only 2 cores`: b_ratio 0, the learner pinned to both cores (stagectl then runs two torch threads);
  `A_ONLY_FACTOR` x the steps, like the 1-core A-only runs.

Everything else is the learning config's (packing false, batch 8, near-greedy Channel-B decoding, the
held-out greedy eval every `phase2_steps / 2` steps). Eval runs in the learner's loop after the optimizer
step and outside `time/step_s`, so the training seconds compared exclude it, as for the 1-core variants;
the server's prefetcher keeps generating meanwhile (a few rollouts for free in the async run).

The analysis reads the same intervals code at equal steps and at equal training wall time, each variant's
mean training seconds to `phase2_steps`, and the async run's overlap figures (learner waits for packs and
at fences, ver lag, drop rate, the realised B share). Runs are named `sep-TASK-...` so the 1-core tables
(which read `TASK-*-seed*`) never include them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from bench import document
from bench.learning_jobs import (
    A_ONLY_FACTOR,
    AB_VARIANTS,
    Job,
    Sizes,
    phase2_overrides,
    run_finished,
    run_jobs,
    train_argv,
)

AB = "AB async separated"
A2 = "A-only 2 cores"
DEFAULT_ARM = ("clean_prefix", 0.5)  # before a confirmation chose one (the check before issue 40)


def choose_arm(tasks: dict[str, Any]) -> tuple[str, float]:
    """(variant, b_ratio) of the confirmed AB group with the best mean class-aware ΔAP vs A-only at equal
    training time over the tasks that ran it (`bench.learning_analysis` rows, JSON form)."""
    per_task = {
        task: {
            (row["variant"], row["b_ratio"]): row["wall"]["d_AP"]["value"]
            for row in t.get("confirm", [])[1:]
            if row.get("wall")
        }
        for task, t in tasks.items()
    }
    return choose_arm_from(per_task)


def choose_arm_from(per_task: dict[str, dict[tuple[str, float], float]]) -> tuple[str, float]:
    """The same choice from per-task {(variant, b_ratio): ΔAP at equal training time} (DEFAULT_ARM if none)."""
    deltas: dict[tuple[str, float], list[float]] = {}
    for groups in per_task.values():
        for key, value in groups.items():
            deltas.setdefault(key, []).append(value)
    if not deltas:
        return DEFAULT_ARM
    return max(deltas, key=lambda k: sum(deltas[k]) / len(deltas[k]))


def two_cores() -> tuple[int, int]:
    """The first two CPUs this process may run on (the learner's core, then the server's)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError(
            f"the learning check's separated phase needs 2 CPUs (learner and rollout server on separate "
            f"cores); this process may run on {len(cpus)}: {cpus}"
        )
    return cpus[0], cpus[1]


def variant_overrides(cores: tuple[int, int], arm: tuple[str, float] = DEFAULT_ARM) -> dict[str, list[str]]:
    """Each separated variant's overrides on top of the phase-2 ones (`arm`: the AB variant and b_ratio)."""
    learner, server = cores
    variant, b_ratio = arm
    return {
        AB: [
            f"stage2_ab.schedule.b_ratio={b_ratio:g}",
            *AB_VARIANTS[variant],
            "stage2_ab.channel_b.mode=async",
            "custom.extra.rollout_matching.rollout_backend=vllm",
            "custom.extra.rollout_matching.vllm.mode=server",
            "custom.extra.rollout_matching.vllm.sync.mode=full",
            "custom.extra.rollout_matching.vllm.sync.transport=http",
            "rollout_server.embedded=true",
            "rollout_server.engine=hf",
            f"launch.cpus=[{learner}]",
            f"rollout_server.cpus=[{server}]",
            "launch.prefetcher_cpus=server",
        ],
        A2: ["stage2_ab.schedule.b_ratio=0", f"launch.cpus=[{learner}, {server}]"],
    }


def run_name(task: str, variant: str, seed: int) -> str:
    return f"sep-{task}-{variant.replace(' ', '_')}-seed{seed}"


def refuse_existing(out: Path, sizes: Sizes) -> None:
    """Before anything runs: the separated runs must not exist yet under `out` (train-ab would refuse
    them one by one, after Stage-1 and whatever ran before)."""
    variants = (AB, A2)
    names = [run_name(t, v, s) for t in sizes.tasks for s in range(sizes.seeds) for v in variants]
    there = [name for name in names if (out / name).exists() and not run_finished(out / name)]
    if there:
        raise ValueError(
            f"learning check: {out} already holds unfinished separated runs ({', '.join(there)}); move them away or "
            "choose another --out (its finished Stage-1 checkpoints are reused either way)"
        )


def separated_jobs(
    task: str,
    config: Path,
    checkpoint: Path,
    sizes: Sizes,
    out: Path,
    cores: tuple[int, int],
    arm: tuple[str, float] = DEFAULT_ARM,
) -> list[Job]:
    """The task's separated runs, in the order they run (one at a time)."""
    jobs = []
    for seed in range(sizes.seeds):
        for variant, overrides in variant_overrides(cores, arm).items():
            steps = sizes.phase2_steps * (A_ONLY_FACTOR if variant == A2 else 1)
            run_out = out / run_name(task, variant, seed)
            argv = train_argv(
                config, run_out, [*phase2_overrides(checkpoint, steps, seed, sizes), *overrides]
            )
            jobs.append(Job(run_out.name, argv, run_out))
    return jobs


def run_phase(
    configs: dict[str, Path],
    checkpoints: dict[str, Path],
    sizes: Sizes,
    out: Path,
    log_dir: Path,
    arm: tuple[str, float] = DEFAULT_ARM,
    tasks: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Run the separated jobs of `tasks` (default: every task), one at a time, and analyse them."""
    cores = two_cores()
    tasks = tasks or sizes.tasks
    started = time.perf_counter()
    jobs = [
        job
        for task in tasks
        for job in separated_jobs(task, configs[task], checkpoints[task], sizes, out, cores, arm)
        if not run_finished(job.out)
    ]
    walls = run_jobs(jobs, 1, log_dir)
    return {
        "cores": list(cores),
        "arm": {"variant": arm[0], "b_ratio": arm[1]},
        "run_wall_s": walls,
        "phase_s": time.perf_counter() - started,
        "tasks": {task: analyse_task(task, out, sizes) for task in tasks},
    }


def reanalyse(out: Path, sizes: Sizes) -> dict[str, Any] | None:
    """`run_phase()`'s result from the separated runs already under `out` (None when there are none): the
    cores from the AB run's config, the phase's wall time from its first run's config to its last final state."""
    finals = sorted(out.glob("sep-*/final_state.json"), key=lambda p: p.stat().st_mtime)
    if not finals:
        return None
    tasks = [t for t in sizes.tasks if any(p.parent.name.startswith(f"sep-{t}-") for p in finals)]
    config = yaml.safe_load((out / run_name(tasks[0], AB, 0) / "config.yaml").read_text())
    cb = config["stage2_ab"]["channel_b"]
    arm = {"variant": _variant_of(cb), "b_ratio": float(config["stage2_ab"]["schedule"]["b_ratio"])}
    phase_s = finals[-1].stat().st_mtime - min((p.parent / "config.yaml").stat().st_mtime for p in finals)
    return {
        "cores": [config["launch"]["cpus"][0], config["rollout_server"]["cpus"][0]],
        "arm": arm,
        "run_wall_s": {},
        "phase_s": phase_s,
        "ran_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(finals[-1].stat().st_mtime)),
        "stage1_reused": [],
        "stage1_wall_s": {},
        "total_s": phase_s,
        "tasks": {task: analyse_task(task, out, sizes) for task in tasks},
    }


def _variant_of(cb: dict[str, Any]) -> str:
    """The AB_VARIANTS name whose overrides give this channel_b section (as written to config.yaml)."""
    for name, overrides in AB_VARIANTS.items():
        wanted = dict(item.removeprefix("stage2_ab.channel_b.").split("=", 1) for item in overrides)
        values = {
            "target": str(cb.get("target")),
            "desc_ce_weight_matched": f"{float(cb.get('desc_ce_weight_matched', 0)):.1f}",
            "mask_correct_matched_desc": str(cb.get("mask_correct_matched_desc", True)).lower(),
            "match.assignment": str((cb.get("match") or {}).get("assignment", "hungarian")),
            "match.desc_gated": str((cb.get("match") or {}).get("desc_gated", False)).lower(),
        }
        defaults = {
            "desc_ce_weight_matched": "0.0",
            "mask_correct_matched_desc": "true",
            "match.assignment": "hungarian",
            "match.desc_gated": "false",
        }
        if all(values[k] == wanted.get(k, defaults.get(k)) for k in values):
            return name
    return str(cb.get("target"))


def _overlap(run_dir: Path) -> dict[str, float]:
    """The async run's overlap figures over all its steps (its metrics.jsonl)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    key = "stage2_ab/async/"
    wall = sum(float(r["time/step_s"]) for r in rows)
    wait = sum(float(r.get("time/wait_packs_s", 0.0)) for r in rows)
    fence = sum(float(r.get("time/fence_s", 0.0)) for r in rows)
    weight_sync = sum(float(r.get("time/weight_sync_s", 0.0)) for r in rows)
    lags = [float(r[key + "ver_lag"]) for r in rows if key + "ver_lag" in r]
    last = rows[-1]
    return {
        "train_s": wall,
        "wait_packs_s": wait,
        "fence_s": fence,
        "weight_sync_s": weight_sync,
        "idle_fraction": (wait + fence) / wall if wall else 0.0,
        "ver_lag_mean": sum(lags) / len(lags) if lags else 0.0,
        "drop_rate": float(last.get(key + "drop_rate", 0.0)),
        "b_ratio_realized": float(last.get(key + "b_ratio_realized", 0.0)),
        "prefetch_busy_s": float(last.get(key + "prefetch_busy_s", 0.0)),
    }


def _delta_f1(vs_baseline: dict[str, Any] | None) -> dict[str, float] | None:
    """ΔF1 against the baseline with its interval (None for the baseline itself)."""
    if vs_baseline is None:
        return None
    f1 = vs_baseline["f1"]
    return {"value": f1.value, "low": f1.low, "high": f1.high}


def analyse_task(task: str, out: Path, sizes: Sizes) -> dict[str, Any]:
    """Equal steps and equal training wall time of AB async separated vs A-only 2 cores (same intervals
    code as the 1-core tables), training seconds, F1 figures the reading needs, and the overlap."""
    from stagectl.report.compare import compare_at, load_run, render_table

    runs = []
    for variant in (AB, A2):
        for seed in range(sizes.seeds):
            path = out / run_name(task, variant, seed)
            if run_finished(path):
                run = load_run(path)
                run.variant = variant  # both would read as their 1-core labels otherwise
                runs.append(run)
    ab_runs = [r for r in runs if r.variant == AB]
    a_runs = [r for r in runs if r.variant == A2]
    if not ab_runs or not a_runs:
        raise ValueError(
            f"learning check, separated phase, {task}: no finished run of {AB} or of {A2} in {out}"
        )
    at = sizes.phase2_steps
    steps = compare_at(runs, {r.path: at for r in runs}, baseline=A2)
    ab_train_s = sum(r.train_s_at[at] for r in ab_runs) / len(ab_runs)
    a_train_s = sum(r.train_s_at[at] for r in a_runs) / len(a_runs)
    step_of = {r.path: at for r in ab_runs}
    for r in a_runs:
        step_of[r.path] = min(r.evals, key=lambda s: abs(r.train_s_at.get(s, float("inf")) - ab_train_s))
    wall = compare_at(runs, step_of, baseline=A2)
    a_end = min(max(r.evals) for r in a_runs)  # A-only's last eval every seed reached
    a_f1_end = sum(float(r.evals[a_end]["f1"]) for r in a_runs) / len(a_runs)
    start_row = json.loads((out / f"{task}-stage1" / "eval.jsonl").read_text().splitlines()[-1])
    overlaps = [_overlap(r.path) for r in ab_runs]
    # the headline: class-aware AP with box vs label beside it, at equal steps and equal training time
    from bench.learning_analysis import Metrics, as_json

    metrics = Metrics(len(ab_runs[0].evals[at]["per_image"]))
    ab_at = [(r.path, r.evals[at], at) for r in ab_runs]
    a_at = [(r.path, r.evals[at], at) for r in a_runs]
    a_wall = [(r.path, r.evals[step_of[r.path]], step_of[r.path]) for r in a_runs]
    config = yaml.safe_load((ab_runs[0].path / "config.yaml").read_text())
    b_ratio_asked = float(config["stage2_ab"]["schedule"]["b_ratio"])
    headline = {
        "steps": [
            {
                "variant": A2,
                "b_ratio": 0.0,
                "seeds": len(a_runs),
                "metrics": metrics.summary(a_at, None),
                "train_s": a_train_s,
            },
            {
                "variant": AB,
                "b_ratio": b_ratio_asked,
                "seeds": len(ab_runs),
                "metrics": metrics.summary(ab_at, a_at),
                "train_s": ab_train_s,
            },
        ],
        "wall": [
            {
                "variant": A2,
                "b_ratio": 0.0,
                "seeds": len(a_runs),
                "metrics": metrics.summary(a_wall, None),
                "train_s": sum(r.train_s_at[step_of[r.path]] for r in a_runs) / len(a_runs),
            },
            {
                "variant": AB,
                "b_ratio": b_ratio_asked,
                "seeds": len(ab_runs),
                "metrics": metrics.summary(ab_at, a_wall),
                "train_s": ab_train_s,
            },
        ],
    }
    by_variant = {row.variant: row for row in steps}
    wall_ab = next(row for row in wall if row.variant == AB)
    return {
        "step": at,
        "seeds": {AB: len(ab_runs), A2: len(a_runs)},
        "table": render_table(steps),
        "train_s": {AB: ab_train_s, A2: a_train_s},
        "equal_wall": {
            "ab_train_s": ab_train_s,
            "a_only_steps": sorted({step_of[r.path] for r in a_runs}),
            "a_only_train_s": [r.train_s_at[step_of[r.path]] for r in a_runs],
            "table": render_table(wall),
            "delta_f1": _delta_f1(wall_ab.vs_baseline),
        },
        "f1": {
            "start": float(start_row["f1"]),
            AB: by_variant[AB].metrics["f1"].value,
            A2: by_variant[A2].metrics["f1"].value,
            "delta_equal_steps": _delta_f1(by_variant[AB].vs_baseline),
            "a_only_end_step": a_end,
            "a_only_end": a_f1_end,
        },
        "overlap": {k: sum(o[k] for o in overlaps) / len(overlaps) for k in overlaps[0]},
        "headline": as_json(headline),
        "b_ratio_asked": b_ratio_asked,
    }


def merge(saved: dict[str, Any] | None, fresh: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """bench/results/learning.json after a separated-only run (`fresh`: its result, no 1-core tasks): the
    saved check with only its `separated` part replaced (the 1-core tables, their meta and wall times
    kept); `fresh` with `meta` where no full-size check was saved yet."""
    if saved is None or saved["result"].get("quick") or not saved["result"].get("tasks"):
        return {"meta": meta, "result": fresh}
    return {"meta": saved["meta"], "result": {**saved["result"], "separated": fresh["separated"]}}


def save(result: dict[str, Any]) -> Path:
    """Merge a separated-only run into bench/results/learning.json (the 1-core tables kept) and rewrite
    BENCHMARKS.md."""
    path = document.RESULTS / "learning.json"
    saved = json.loads(path.read_text()) if path.is_file() else None
    meta = {"ran_at": result["separated"]["ran_at"], "seconds": result["total_s"]}
    document.RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merge(saved, result, meta), indent=2))
    document.write_markdown()
    return path
