"""The async-vs-step section of BENCHMARKS.md (`bench.bench_async`): the runs table, the ratio and bound
per config, and a plot of where each run's learner time went."""

from __future__ import annotations

from statistics import median
from typing import Any

from bench.async_configs import CONFIGS, PLACEMENTS, VARIANTS

FULL_STEPS = 18  # bench_async.run's default

ROWS: tuple[tuple[str, str, str | None], ...] = (
    ("b_steps", "B steps / steps measured", None),  # a run that trains fewer B steps is not faster
    ("trained_tokens_per_s", "trained tokens/s", "{:.0f}"),
    ("wall_per_step_s", "wall per step (s)", "{:.2f}"),
    ("overlap_ratio", "overlap max(R, T) / W", "{:.2f}"),
    ("learner_idle_fraction", "learner idle fraction", "{:.3f}"),
    ("idle_floor", "idle floor max(0, 1 - T/R)", "{:.3f}"),
    ("drop_rate", "drop rate", "{:.3f}"),
    ("weight_sync_share", "weight-sync share of wall", "{:.3f}"),
    ("share/forward_backward", "forward/backward share", "{:.3f}"),
    ("share/collate", "collate share (learner thread)", "{:.3f}"),
    ("share/prefetch_build", "prefetcher build + collate (its thread)", "{:.3f}"),
    ("learner_thread_cpu_share", "learner thread CPU / wall", "{:.2f}"),
    ("other_threads_cpu_share", "other threads' CPU / wall", "{:.3f}"),
)


def run_names(r: dict[str, Any]) -> list[str]:
    return [
        f"{c}/{m}/{p}"
        for c, modes in CONFIGS.items()
        for m in modes
        for p in PLACEMENTS
        if f"{c}/{m}/{p}" in r["runs"]
    ]


def async_section(r: dict[str, Any]) -> list[str]:
    if "runs" not in r:  # results of the earlier bench (before the placement table)
        return ["Results predate the separated table; re-run `python -m bench async`."]
    load = r.get("loadavg", [])
    names = run_names(r)
    lines = [
        "One learner rank and an embedded hf rollout server on the tiny model. `separated`: learner and server "
        "pinned to one core each (`launch.cpus`, `rollout_server.cpus`; the async prefetcher thread on the "
        "server's core, `launch.prefetcher_cpus: server`); `shared`: nothing pinned, one torch thread each. "
        "Configs: `b0.5` (b_ratio 0.5, 48 new tokens, async packed bs 1, sync every 2), `example` "
        "(examples/tiny/train_ab_async.yaml on one rank), `b1.0` (B only, sync every step). R = rollout busy "
        "(step: its rollout time; async: the prefetcher's busy time), idle = `time/wait_packs_s` + "
        "`time/fence_s`, T = W - idle; figures after 2 warm-up steps. The idle floor is the least a learner "
        "waits when its rollouts take longer than its own work (R > T), however well the two overlap. The bound "
        "(R + T) / max(R, T) takes step mode's R and T = W - R, and assumes each side runs as fast "
        "beside the other as step mode measured it alone; the last column says how much longer the server took per "
        "rollout in the async run (above 1: it generated slower while the learner computed)."
        + "".join(
            f" `{name}`: `{base}` with "
            + ", ".join(f"`{key}: {value}`" for key, value in keys.items())
            + (
                " (its own step runs)."
                if "step" in CONFIGS[name]
                else f" (compared with `{base}`'s step runs)."
            )
            for name, (base, keys) in VARIANTS.items()
        ),
        "",
        f"{r['max_steps']} steps per run"
        + (f"; 1-minute load average {load[0]:.1f} at the start, {load[-1]:.1f} at the end" if load else "")
        + (" (**a loaded machine**)" if load and max(load) > 3 else "")
        + (
            f" (**a short check**: `python -m bench async` runs {FULL_STEPS})"
            if r["max_steps"] < FULL_STEPS
            else ""
        )
        + ".",
    ]
    groups: dict[tuple[object, object], list[str]] = {}  # one sentence per `--only ... --save` invocation
    for name, how in r.get("rerun", {}).items():
        groups.setdefault((how.get("ran_at"), how.get("max_steps")), []).append(name)
    for names_rerun in groups.values():
        how = r["rerun"][names_rerun[0]]
        runs_load = how.get("loadavg") or []
        lines[-1] += (
            " "
            + ", ".join(f"`{name}`" for name in names_rerun)
            + f" re-run alone (`--only ... --save`) at {how.get('ran_at')}, {how.get('max_steps')} steps"
            + (f", load {runs_load[0]:.1f}-{runs_load[-1]:.1f}" if runs_load else "")
            + (" (**a loaded machine**)" if runs_load and max(runs_load) > 3 else "")
            + (" (**a short check**)" if (how.get("max_steps") or FULL_STEPS) < FULL_STEPS else "")
            + "."
        )
    lines += [
        "",
        "| run | " + " | ".join(label for _, label, _ in ROWS) + " |",
        "|---|" + "---|" * len(ROWS),
    ]
    for name in names:
        run = r["runs"][name]
        cells = [
            "—" if key not in run else f"{run[key]}/{run['steps']}" if fmt is None else fmt.format(run[key])
            for key, _, fmt in ROWS
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| config / placement | async / step trained tokens/s | overlap bound (R + T) / max(R, T) | of the bound "
        "| server s per rollout, async / step |",
        "|---|---|---|---|---|",
    ]
    for key, c in r["compare"].items():
        cost = c.get("rollout_cost_async_over_step")
        lines.append(
            f"| {key} | {c['async_over_step']:.2f}x | {c['bound']:.2f}x | {c['of_bound']:.2f} | "
            + ("—" if cost is None else f"{cost:.2f}")
            + " |"
        )
    separated = [
        run
        for name, run in r["runs"].items()
        if name.endswith("/separated") and "learner_thread_cpu_share" in run
    ]
    if separated:
        cpu = [run["learner_thread_cpu_share"] for run in separated]
        # judged outside the learner's waits: a step-mode learner waits on rollouts by design
        busy = [
            run["learner_thread_cpu_share"] / (1 - run.get("learner_idle_fraction", 0.0))
            for run in separated
            if run.get("learner_idle_fraction", 0.0) < 1
        ]
        lines += [
            "",
            f"Quietness check: the learner thread's CPU time was {min(cpu):.2f}-{max(cpu):.2f} of the wall in "
            f"the separated runs, {min(busy):.2f}-{max(busy):.2f} of the time outside its waits (a pinned "
            "learner on a quiet core is near 1 there); "
            + (
                "well below that, other work shared the pinned cores and the table measures the machine more "
                "than the placement."
                if min(busy) < 0.8
                else "the pinned cores were the runs' own."
            ),
        ]
    spread = r.get("repeats")
    if spread:
        lines += ["", *repeat_lines(spread)]
    example = r["compare"].get("example/separated")
    lines.append("")
    if example is not None:
        rows = (spread or {}).get("runs", {}).get("example") or []
        values = [example["of_bound"], *(x["of_bound"] for x in rows)]
        wanted = r["runs"].get("example/step/separated", {}).get("b_steps")
        trained = [
            r["runs"].get("example/async/separated", {}).get("b_steps"),
            *(x.get("b_steps") for x in rows),
        ]
        all_b = [wanted is None or got is None or got >= wanted for got in trained]
        lines.append(
            "Target: async reaches >= 0.9 of the bound on the example config (separated): "
            f"{example['of_bound']:.3f} in the table's run"
            + (f"; {_spread([x['of_bound'] for x in rows], '{:.3f}')} over the repeats" if rows else "")
            + f": {_verdict([v >= 0.9 - 1e-9 and b for v, b in zip(values, all_b, strict=True)])}."
        )
    fenced = fenced_line(r, spread)
    if fenced:
        lines.append(fenced)
    readings = []
    for config in [c for c in CONFIGS if c == "b1.0" or VARIANTS.get(c, ("",))[0] == "b1.0"]:
        heavy = r["compare"].get(f"{config}/separated")
        async_run = r["runs"].get(f"{config}/async/separated", {})
        step_run = r["runs"].get(f"{config}/step/separated") or r["runs"].get("b1.0/step/separated", {})
        if heavy is None or "learner_idle_fraction" not in async_run:
            continue
        rows = (spread or {}).get("runs", {}).get(config) or []
        runs = [(heavy["async_over_step"], async_run["learner_idle_fraction"])]
        runs += [(x["async_over_step"], x["idle"]) for x in rows]
        # a run that trained Channel-A in place of wanted B steps meets no target (it only looks faster)
        wanted = step_run.get("b_steps")
        all_b = [wanted is None or async_run.get("b_steps", wanted) >= wanted]
        all_b += [wanted is None or x.get("b_steps", wanted) >= wanted for x in rows]
        waits = (
            f"; step mode waits {step_run['learner_idle_fraction']:.0%} of its wall on rollouts"
            if step_run
            else ""
        )
        lines.append(
            f"Target: rollout-heavy ({config}{waits}; separated) async / step >= 1.6x with learner idle <= 10%: "
            f"{heavy['async_over_step']:.2f}x, idle {async_run['learner_idle_fraction']:.3f} in the table's run"
            + (
                f"; {_spread([x['async_over_step'] for x in rows], '{:.2f}x')}, idle "
                f"{_spread([x['idle'] for x in rows], '{:.3f}')} over the repeats"
                if rows
                else ""
            )
            + ": "
            + _verdict(
                [
                    ratio >= 1.6 - 1e-9 and idle <= 0.10 + 1e-9 and b
                    for (ratio, idle), b in zip(runs, all_b, strict=True)
                ]
            )
            + "."
        )
        floors = [async_run.get("idle_floor")] + [x.get("idle_floor") for x in rows]
        if all(f is not None for f in floors):
            idles = [idle for _, idle in runs]
            over = sum(f > 0.10 for f in floors)
            readings.append(
                f"`{config}`: idle {median(idles):.3f} over a floor of {median(floors):.3f} (medians of "
                f"{len(runs)} runs); the floor alone exceeds 10% in {over} of {len(runs)}"
            )
    if readings:
        lines.append(
            "Reading: the idle floor max(0, 1 - T/R) is what a rollout-bound learner must wait; the idle above "
            "it is the wait for a burst that is late (step-to-step noise): at the B step's gate with "
            "`in_flight_sync` (every config here but `example-fenced`), at the fence without. "
            + "; ".join(readings)
            + '. Why, and how to size a node from R and T: docs/placement.md, "Where the learner\'s time goes".'
        )
    return lines


def fenced_line(r: dict[str, Any], spread: dict[str, Any] | None) -> str | None:
    """`example` (in-flight weight sync) beside `example-fenced` (the sync waits for the burst in flight):
    the table's pair and the repeats', separated."""
    table = (r["compare"].get("example/separated"), r["compare"].get("example-fenced/separated"))
    runs = (spread or {}).get("runs", {})
    rows = list(zip(runs.get("example", []), runs.get("example-fenced", []), strict=False))
    kept = [(a, b) for a, b in [table, *rows] if a and b]
    if table[0] and table[1]:  # the table's compare rows carry no idle: take it from its async runs
        kept[0] = (
            {**table[0], "idle": r["runs"]["example/async/separated"]["learner_idle_fraction"]},
            {**table[1], "idle": r["runs"]["example-fenced/async/separated"]["learner_idle_fraction"]},
        )
    if not kept:
        return None
    ins, outs = [a for a, _ in kept], [b for _, b in kept]
    return (
        f"In-flight weight sync (`example`) against the fenced one (`example-fenced`), separated, {len(kept)} "
        "side-by-side pair(s) (the table's and the repeats'), min/median/max: async / step "
        f"{_spread([a['async_over_step'] for a in ins], '{:.2f}x')} against "
        f"{_spread([b['async_over_step'] for b in outs], '{:.2f}x')}, of the bound "
        f"{_spread([a['of_bound'] for a in ins], '{:.2f}')} against {_spread([b['of_bound'] for b in outs], '{:.2f}')}, "
        f"learner idle {_spread([a['idle'] for a in ins], '{:.3f}')} against "
        f"{_spread([b['idle'] for b in outs], '{:.3f}')}."
    )


def _verdict(oks: list[bool]) -> str:
    met = sum(oks)
    if len(oks) == 1:
        return "met (one run)" if met else "not met (one run)"
    if met == len(oks):
        return f"met in all {len(oks)} runs"
    return f"{'met' if 2 * met > len(oks) else 'not met'}, {met} of {len(oks)} runs within it"


def _spread(values: list[float], fmt: str) -> str:
    """min/median/max; the median of an even count is the mean of the middle two (as `statistics.median`)."""
    return "/".join(fmt.format(v) for v in (min(values), median(values), max(values)))


def repeat_lines(spread: dict[str, Any]) -> list[str]:
    """The targets as a spread: the separated step/async pairs of the TARGETS configs run `n` times."""
    load = spread.get("loadavg") or [0.0]
    lines = [
        f"Repeats (`python -m bench.bench_async --repeats {spread['n']} --save`, {spread['ran_at']}, "
        f"{spread['max_steps']} steps a run, load {load[0]:.1f}-{load[-1]:.1f}"
        + (", **a loaded machine**" if max(load) > 3 else "")
        + "), separated, min/median/max:",
        "",
        "| config | async / step | of the bound | async learner idle | its floor max(0, 1 - T/R) "
        "| server s per rollout, async / step |",
        "|---|---|---|---|---|---|",
    ]
    for config, rows in spread["runs"].items():
        floors = [x["idle_floor"] for x in rows if "idle_floor" in x]
        lines.append(
            f"| {config} | {_spread([x['async_over_step'] for x in rows], '{:.2f}x')} | "
            f"{_spread([x['of_bound'] for x in rows], '{:.2f}')} | {_spread([x['idle'] for x in rows], '{:.3f}')} | "
            + (_spread(floors, "{:.3f}") if len(floors) == len(rows) else "—")
            + f" | {_spread([x.get('rollout_cost_async_over_step', float('nan')) for x in rows], '{:.2f}')} |"
        )
    return lines


def async_plot(r: dict[str, Any], ax: Any) -> bool:
    """Stacked shares of each run's wall: the learner's phases and its idle rest."""
    if "runs" not in r:
        return False
    names = run_names(r)
    parts = (
        ("share/forward_backward", "forward/backward"),
        ("share/optimizer", "optimizer"),
        ("share/collate", "collate (learner)"),
        ("share/wait_packs", "waiting for rollouts/packs"),
        ("share/fence", "fence"),
        ("share/weight_sync", "weight sync"),
    )
    bottom = [0.0] * len(names)
    for key, label in parts:
        values = [r["runs"][n].get(key, 0.0) for n in names]
        ax.bar(range(len(names)), values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(names)), [n.replace("/", "\n") for n in names], fontsize=6)
    ax.set_ylabel("share of wall time")
    ax.set_title("Where the learner's wall time goes (async vs step, separated vs shared)")
    return True
