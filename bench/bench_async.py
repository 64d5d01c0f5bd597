"""Async Channel-B against step mode on the tiny workload (1 learner rank + an embedded hf rollout server),
with the learner and the server on separate cores and sharing the machine.

Configs (each run in step mode and async mode, one learner rank):
- `b0.5`: b_ratio 0.5, GAS 2, `global_max_length` 2048, 48 new tokens, 8 rollouts per step-mode B step,
  async packed bs 1 (a micro-batch is one sequence) with sync every 2 steps; step mode also with
  `enable_pipeline`;
- `example`: the settings of examples/tiny/train_ab_async.yaml (1024 tokens, 96 new tokens, queue 8,
  target 4, sync every 2) on one learner rank instead of two (`--nproc 1`: two ranks and a server need
  three cores);
- `b1.0`: rollout-heavy, B only: sync every step, queue 3, target 2, decode batch 8 (step mode waits ~40% of
  its wall on rollouts);
- variants (`VARIANTS`: a base config with some keys changed, in both modes): `b1.0n40` (`b1.0` with 40 new
  tokens instead of 48: with the server's old sampler, `b1.0` was rollout-bound in async and this was the
  balanced variant; both are read against the rollout-heavy target); `example-fenced` (`example` with
  `in_flight_sync: false`, async only: the weight sync waits for the burst in flight, as it did before the
  servers swapped weights in between calls).

Placements: `separated` pins the learner to one core and the server to another (`launch.cpus`,
`rollout_server.cpus`, one torch thread each); `shared` pins nothing (one torch thread each, the OS
places both).

Per run, after 2 warm-up steps: trained tokens/s, wall per step, R (rollout busy: step mode's rollout
time, async's prefetcher busy time), the learner's idle time (`time/wait_packs_s` + `time/fence_s`), T = W -
idle, overlap max(R, T) / W, the idle fraction and its floor max(0, 1 - T/R) (a rollout-bound learner must
wait that long whatever the overlap), the drop rate, the weight-sync share of the wall, and the share of every
learner phase. Per config and placement: async / step trained tokens/s, and the overlap
bound (R + T) / max(R, T) from step mode's own R and T = W - R (what perfect overlap would give).

Run: `python -m bench async` (the full section, ~6 min on 2 quiet cores), or
`python -m bench.bench_async --steps 8` (a short check; add `--save` to write the section anyway).
`--only NAME` (repeatable, a prefix: `b1.0/` is b1.0 alone, `b1.0` also its variants) with `--save` merges
those runs into the saved results and keeps the other rows. `python -m bench.cross_core` says how much the
two cores slow each other (the bound assumes they do not).
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

import yaml

from bench import document
from bench.async_configs import CONFIGS, PLACEMENTS, VARIANTS
from stagectl.timing import PHASES

ROOT = Path(__file__).parents[1]
WARMUP, TAIL = 2, 1


def _config(
    out: Path, config: str, mode: str, max_steps: int, cpus: tuple[int, int] | None
) -> dict[str, Any]:
    config, changes = VARIANTS.get(config, (config, {}))
    example = config == "example"
    b_only = config == "b1.0"
    cfg: dict[str, Any] = {
        "model": {"name_or_path": "builtin:tiny-qwen2.5-vl"},
        "data": {"synthetic": {"num_samples": 256, "seed": 0, "image_size": 112, "max_objects": 3}},
        "global_max_length": 1024 if example else 2048,
        "training": {
            "packing": True,
            "per_device_train_batch_size": 1,
            "gradient_accumulation_steps": 2,
            "learning_rate": 2e-3 if example else 1e-3,
            "max_steps": max_steps,
            "output_dir": str(out),
        },
        "launch": {"nproc_per_node": 1},
        "custom": {
            "extra": {
                "rollout_matching": {
                    "rollout_backend": "vllm",
                    "max_new_tokens": 96 if example else 48,
                    "vllm": {"mode": "server", "sync": {"mode": "full", "transport": "http"}},
                }
            }
        },
        "stage2_ab": {
            "schedule": {"b_ratio": 1.0 if b_only else 0.5},
            "channel_b": {
                "mode": "step" if mode.startswith("step") else "async",
                "enable_pipeline": mode == "step_pipeline",
                "rollouts_per_step": 8,
                "rollout_decode_batch_size": 8 if b_only else 4,
                "async": {
                    "queue_limit": 3 if b_only else 8,
                    "version_window": 1,
                    "prefetch_target_packs": 2 if b_only else 4,
                    "sync_every_steps": 1 if b_only else 2,
                    "in_flight_sync": True,  # the default, spelled out for the `example-fenced` variant
                },
            },
        },
        "rollout_server": {"embedded": True, "max_batch_size": 8},
    }
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = cfg
        for key in parents:
            node = node[key]
        if leaf not in node:
            raise KeyError(f"variant key {dotted} is not in the {config} config")
        node[leaf] = value
    if cpus is not None:
        cfg["launch"]["cpus"] = [cpus[0]]
        cfg["rollout_server"]["cpus"] = [cpus[1]]
    return cfg


def _train(name: str, cfg: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    # one intra-op thread for each side when nothing is pinned (pinned runs get one per CPU from stagectl):
    # on 2 shared cores, oversubscribed torch threads make step times swing by 10x
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "stagectl", "train-ab", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    out = Path(cfg["training"]["output_dir"])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _sum(rows: list[dict[str, Any]], key: str) -> float:
    return sum(float(r.get(key, 0.0)) for r in rows)


def _delta(first: dict[str, Any], last: dict[str, Any], key: str) -> float:
    """How much a counter grew over the measured rows (0 where a run predates it)."""
    return float(last.get(key, 0.0)) - float(first.get(key, 0.0))


def summarise(all_rows: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """One run's figures over its rows after the warm-up (the last `TAIL` rows too: the final save)."""
    rows = all_rows[WARMUP : len(all_rows) - TAIL]
    wall = _sum(rows, "time/step_s")
    idle = _sum(rows, "time/wait_packs_s") + _sum(rows, "time/fence_s")
    out: dict[str, Any] = {
        "steps": len(rows),
        "b_steps": sum(r["kind"] == "B" for r in rows),
        "wall_per_step_s": wall / len(rows),
        "trained_tokens_per_s": _sum(rows, "tokens") / wall,
        "learner_idle_fraction": idle / wall,
        "weight_sync_share": _sum(rows, "time/weight_sync_s") / wall,
        **{f"share/{phase}": _sum(rows, f"time/{phase}_s") / wall for phase in PHASES},
        "learner_thread_cpu_share": _sum(rows, "time/learner_thread_cpu_s") / wall,
        "other_threads_cpu_share": _sum(rows, "time/other_threads_cpu_s") / wall,
    }
    if mode.startswith("step"):
        rollout_busy = _sum(rows, "time/rollout_s")
        out["drop_rate"] = 0.0
        rollouts = _sum(rows, "rollout/n_samples")
        out["request_s_per_rollout"] = rollout_busy / rollouts if rollouts else 0.0
    else:
        key = "stage2_ab/async/"
        first, last = all_rows[WARMUP - 1], rows[-1]
        rollout_busy = last[key + "prefetch_busy_s"] - first[key + "prefetch_busy_s"]
        requested = last[key + "rollouts_requested_total"] - first[key + "rollouts_requested_total"]
        dropped = last[key + "rollouts_dropped_total"] - first[key + "rollouts_dropped_total"]
        out["drop_rate"] = dropped / requested if requested else 0.0
        requests = _delta(first, last, key + "rollout_requests_total")
        bursts = _delta(first, last, key + "prefetch_success_total")
        out["rollouts_per_request"] = requested / requests if requests else 0.0
        out["requests_per_burst"] = requests / bursts if bursts else 0.0
        out["request_s_per_rollout"] = (
            _delta(first, last, key + "rollout_request_s") / requested if requested else 0.0
        )
        syncs = _sum(rows, "stage2_ab/async/synced")
        out["fence_s_per_sync"] = _sum(rows, "time/fence_s") / syncs if syncs else 0.0
        out["share/prefetch_request"] = _delta(first, last, key + "rollout_request_s") / wall
        out["share/prefetch_build"] = (
            _sum(rows, "time/prefetch_build_s") + _sum(rows, "time/prefetch_collate_s")
        ) / wall
    learner_busy = wall - idle
    tokens = _sum(rows, "tokens")
    out.update(
        rollout_busy_s=rollout_busy,
        learner_busy_s=learner_busy,
        # per trained token (A tokens included): what each side costs
        rollout_ms_per_token=1e3 * rollout_busy / tokens if tokens else 0.0,
        learner_ms_per_token=1e3 * learner_busy / tokens if tokens else 0.0,
        overlap_ratio=max(rollout_busy, learner_busy) / wall,
        # the least idle a learner can have when the rollouts take longer than its own work (R > T)
        idle_floor=max(0.0, 1.0 - learner_busy / rollout_busy) if rollout_busy else 0.0,
    )
    return out


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per config and placement: async / step tokens/s and step mode's overlap bound (R + T) / max(R, T)
    with R its rollout time and T = W - R."""
    out: dict[str, Any] = {}
    for config in CONFIGS:
        for placement in PLACEMENTS:
            base = config if "step" in CONFIGS[config] else VARIANTS.get(config, (config, {}))[0]
            step, async_ = runs.get(f"{base}/step/{placement}"), runs.get(f"{config}/async/{placement}")
            if step is None or async_ is None:
                continue
            wall = step["wall_per_step_s"] * step["steps"]
            r = step["rollout_busy_s"]
            bound = wall / max(r, wall - r)
            ratio = async_["trained_tokens_per_s"] / step["trained_tokens_per_s"]
            out[f"{config}/{placement}"] = {
                "async_over_step": ratio,
                "bound": bound,
                "of_bound": ratio / bound,
                # > 1: a rollout costs the server more while the learner computes beside it (per rollout, not
                # per trained token: the A tokens in the trained ones differ between the modes)
                "rollout_cost_async_over_step": (
                    async_["request_s_per_rollout"] / step["request_s_per_rollout"]
                    if step.get("request_s_per_rollout") and async_.get("request_s_per_rollout")
                    else None
                ),
            }
    return out


def run(max_steps: int = 18, only: list[str] | None = None) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError("the separated runs need 2 CPUs")
    cpus = (cores[0], cores[1])
    results: dict[str, Any] = {
        "max_steps": max_steps,
        "ran_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg": [os.getloadavg()[0]],
        "runs": {},
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        # interleaved: the two placements of one run back to back, so load drifts hit both alike
        for config, modes in CONFIGS.items():
            for mode in modes:
                for placement in PLACEMENTS:
                    name = f"{config}/{mode}/{placement}"
                    if only and not any(name.startswith(o) for o in only):
                        continue
                    out = Path(tmp) / name.replace("/", "_")
                    cfg = _config(out, config, mode, max_steps, cpus if placement == "separated" else None)
                    rows = _train(name.replace("/", "_"), cfg, Path(tmp))
                    results["runs"][name] = summarise(rows, mode)
                    print(name, {k: round(v, 3) for k, v in results["runs"][name].items()}, flush=True)
    results["loadavg"].append(os.getloadavg()[0])
    results["total_s"] = time.perf_counter() - started
    results["compare"] = compare(results["runs"])
    return results


def merge(saved: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """`--only ... --save`: the saved results with `new`'s runs replacing or adding theirs (each new run
    keeps its own steps and load average, `rerun`), the comparison recomputed over the merged runs."""
    if saved is None or "runs" not in saved:
        return new
    how = {key: new.get(key) for key in ("max_steps", "loadavg", "ran_at")}
    rerun = {name: how for name in new["runs"]}
    runs = {**saved["runs"], **new["runs"]}
    earlier = {name: how for name, how in saved.get("rerun", {}).items() if name not in rerun}
    return {
        **saved,
        "runs": runs,
        "rerun": {**earlier, **rerun},
        "total_s": saved.get("total_s", 0.0) + new["total_s"],
        "compare": compare(runs),
    }


# the configs the targets are read on (#26: the example, and the rollout-heavy b1.0 and b1.0n40),
# repeated by `--repeats`
TARGETS = ("example", "example-fenced", "b1.0", "b1.0n40")


def repeats(n: int, max_steps: int = 18) -> dict[str, Any]:
    """The targets' separated step/async pairs `n` times, interleaved: per config a list of
    {async_over_step, of_bound, async idle, rollout cost async / step}, so the targets read as a spread."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError("the separated runs need 2 CPUs")
    out: dict[str, Any] = {"n": n, "max_steps": max_steps, "loadavg": [os.getloadavg()[0]], "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        for rep in range(n):
            pair: dict[str, Any] = {}  # this repeat's runs: a variant without step runs uses its base's
            for config in TARGETS:
                for mode in [m for m in ("step", "async") if m in CONFIGS[config]]:
                    name = f"{config}_{mode}_rep{rep}"
                    cfg = _config(Path(tmp) / name, config, mode, max_steps, (cores[0], cores[1]))
                    pair[f"{config}/{mode}/separated"] = summarise(_train(name, cfg, Path(tmp)), mode)
                ratio = compare(pair)[f"{config}/separated"]
                async_run = pair[f"{config}/async/separated"]
                row = {
                    **ratio,
                    "idle": async_run["learner_idle_fraction"],
                    "idle_floor": async_run["idle_floor"],
                    "b_steps": async_run["b_steps"],
                    "steps": async_run["steps"],
                }
                out["runs"].setdefault(config, []).append(row)
                print(f"{config} repeat {rep}:", {k: round(v, 3) for k, v in row.items()}, flush=True)
    out["loadavg"].append(os.getloadavg()[0])
    out["ran_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return out


def prefetcher_ab(max_steps: int = 8, repeats: int = 2, config: str = "example") -> None:
    """`launch.prefetcher_cpus` learner vs server on one config, async, separated, interleaved."""
    cores = sorted(os.sched_getaffinity(0))
    keys = (
        "trained_tokens_per_s",
        "learner_idle_fraction",
        "request_s_per_rollout",
        "learner_thread_cpu_share",
        "share/forward_backward",
        "share/fence",
    )
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        for rep in range(repeats):
            for where in ("learner", "server"):
                name = f"{config}_async_prefetcher_{where}_{rep}"
                cfg = _config(Path(tmp) / name, config, "async", max_steps, (cores[0], cores[1]))
                cfg["launch"]["prefetcher_cpus"] = where
                s = summarise(_train(name, cfg, Path(tmp)), "async")
                print(f"prefetcher on {where} ({rep}):", {k: round(s[k], 3) for k in keys}, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=18, help="optimizer steps per run (2 warm-up, 1 tail)")
    parser.add_argument("--only", action="append", help="run names starting with this (e.g. b0.5/async)")
    parser.add_argument(
        "--save",
        action="store_true",
        help="write bench/results/async.json and BENCHMARKS.md (with --only: merge these runs into the saved ones)",
    )
    parser.add_argument(
        "--prefetcher-ab", action="store_true", help="only: prefetcher on learner vs server CPUs"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="only: the targets' separated pairs (example, b1.0, b1.0n40) N times; with --save, kept beside the table",
    )
    parser.add_argument(
        "--ab-config", default="example", choices=list(CONFIGS), help="--prefetcher-ab's config"
    )
    args = parser.parse_args()
    if args.prefetcher_ab:
        prefetcher_ab(args.steps, config=args.ab_config)
        return
    if args.repeats:
        spread = repeats(args.repeats, args.steps)
        if args.save:
            path = document.RESULTS / "async.json"
            saved = json.loads(path.read_text())  # the table the repeats sit beside
            saved["result"]["repeats"] = spread
            path.write_text(json.dumps(saved, indent=2))
            document.write_markdown()
        return
    result = run(args.steps, args.only)
    print(json.dumps(result["compare"], indent=2))
    if args.save:
        path = document.RESULTS / "async.json"
        if args.only and path.exists():  # keep the other rows: merge these runs into the saved ones
            saved = json.loads(path.read_text())
            result = merge(saved["result"], result)
            meta = {**saved["meta"], "seconds": result["total_s"]}
        else:
            meta = {"ran_at": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": result["total_s"]}
        path.write_text(json.dumps({"meta": meta, "result": result}, indent=2))
        document.write_markdown()


if __name__ == "__main__":
    main()
