"""BENCHMARKS.md: the per-rank memory section (`bench.bench_memory`: measured vs `stagectl.memory`) and the
FSDP host-memory section (`bench.bench_fsdp`: loading, weight sync from shards, gradient accumulation)."""

from __future__ import annotations

from typing import Any


def memory(r: dict[str, Any]) -> list[str]:
    mib = 1024**2
    lines = [
        f"Per-rank memory of the tiny Qwen2.5-VL's training step (float32, AdamW, one packed Channel-A micro-batch "
        f"of up to {r['global_max_length']} tokens, sdpa attention), {r['steps']} steps after a first one, each rank its own "
        "process on gloo. *Measured* = torch-tracked peak bytes (`MemTracker`: every tensor storage by kind, the CPU "
        "analogue of `max_memory_allocated`), the moment the total peaks; *estimate* = `stagectl.memory` for the "
        "same knobs (world size, parallelism, the micro-batch's real tokens and image-token share). fsdp: the "
        "learner's own FSDP2 sharding (`stagectl.learner.sharding.shard`: `fully_shard` per block, then the root); "
        "+ckpt: gradient checkpointing. MiB. tokens/s: each rank's own, timed over the same steps without the "
        f"tracker (CPU, 1 thread per rank, {r['steps']} steps on cores shared with other work: a reading of the "
        f"machine at that moment more than of the parallelism{_fsdp_vs_ddp(r)}).",
        "",
        "| run | rank | tokens | params: measured / est. | optimizer: measured / est. | activations + temp: "
        "measured / est. (act + logits) | grads at the peak / est. | total: measured / est. | est. / measured | "
        "peak RSS - RSS before load | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in r["runs"]:
        for k in run["ranks"]:
            m, e = k["tracked_peak"], k["estimate"]
            lines.append(
                f"| {run['parallelism']} x{run['world_size']}{' +ckpt' if run['gradient_checkpointing'] else ''} | {k['rank']} | {k['num_tokens']} | "
                f"{m['Parameter'] / mib:.2f} / {e['weights'] / mib:.2f} | "
                f"{m['Optstate'] / mib:.2f} / {e['optimizer'] / mib:.2f} | "
                f"{(m['Activation'] + m['Temp']) / mib:.1f} / {(e['activations'] + e['logits']) / mib:.1f} | "
                f"{m['Gradient'] / mib:.2f} / {e['grads'] / mib:.2f} | "
                f"{m['Total'] / mib:.1f} / {e['total'] / mib:.1f} | {e['total'] / m['Total']:.2f} | "
                f"{(k['peak_rss'] - k['rss_before_model']) / mib:.0f} | {k.get('tokens_per_s', 0.0):.0f} |"
            )
    ratios = {
        ckpt: [
            k["estimate"]["total"] / k["tracked_peak"]["Total"]
            for run in r["runs"]
            for k in run["ranks"]
            if run["gradient_checkpointing"] == ckpt
        ]
        for ckpt in (False, True)
    }
    spans = {ckpt: sorted({f"{min(v):.2f}", f"{max(v):.2f}"}) for ckpt, v in ratios.items() if v}
    summary = ", ".join(
        f"{'-'.join(span)} {'with' if ckpt else 'without'} checkpointing" for ckpt, span in spans.items()
    )
    return [
        *lines,
        "",
        f"Estimate / measured total: {summary}. Parameters and optimizer state are exact (fsdp halves the "
        "optimizer state on 2 ranks, as estimated). The measured gradients are 0 at the peak: with "
        "`zero_grad(set_to_none=True)` the peak falls at the start of the backward, before any gradient exists. "
        "Without checkpointing the estimate is a few percent low: activations and temporaries at that moment "
        "(the logits' gradient, the loss's and CPU sdpa's temporaries) exceed the one layer of gradients it "
        "allows, more than its unneeded gradients make up. With checkpointing it is high: it adds every kind's "
        "maximum, and the rebuilt layer's gradients never coexist with the logits' gradient. fsdp's measured "
        "parameters include the blocks unsharded at the peak, which the estimate books under buffers; DDP's "
        "buckets are allocated at DDP construction, before tracking starts, so only RSS sees them. RSS moves by "
        "more than the tracked bytes (allocator caching, gloo, autograd bookkeeping). On this model activations "
        "dominate, so ddp and fsdp differ by a few MiB; the table in docs/memory.md is where sharding matters.",
    ]


def _fsdp_vs_ddp(r: dict[str, Any]) -> str:
    """The memory table's tokens/s of fsdp x2 beside ddp x2, as measured (either may read faster)."""
    speeds: dict[str, list[float]] = {}
    for run in r["runs"]:
        if run["world_size"] == 2 and not run["gradient_checkpointing"]:
            speeds[run["parallelism"]] = [k.get("tokens_per_s", 0.0) for k in run["ranks"]]
    if not {"fsdp", "ddp"} <= set(speeds):
        return ""
    fsdp, ddp = speeds["fsdp"], speeds["ddp"]
    return (
        f"; here fsdp x2 read {min(fsdp):.0f}-{max(fsdp):.0f} against ddp x2's {min(ddp):.0f}-{max(ddp):.0f}, "
        "so this table does not show what fsdp's all-gathers and reduce-scatters cost"
    )


def fsdp(r: dict[str, Any]) -> list[str]:
    sync0 = r["sync"][0]["ranks"][0]
    lines = [
        f"2 gloo ranks, the tiny Qwen2.5-VL with a widened language model ({r['layers']} layers, MLP width "
        f"{r['intermediate']}): {sync0['state_mib'] * 2:.0f} MiB of float32 weights, largest tensor "
        f"{sync0['largest_tensor_float32_mib']:.0f} MiB, sharded by the learner's `sharding.shard`. *Extra* = the "
        "process's RSS high-water mark during the part minus its RSS when the part began (VmHWM reset through "
        "`/proc/self/clear_refs`; glibc pinned to mmap allocations of 64 KiB or more, so freed tensors leave "
        "the RSS).",
        "",
        "**Loading and sharding.** *every rank*: each rank builds the whole float32 model, then shards it (the "
        "learner before); *rank 0*: rank 0 builds it, rank 1 builds it on the meta device and gets its shards "
        "from rank 0 (`sharding.shard_from_rank0`, the learner now).",
        "",
        "| who loads | rank 0 extra MiB | rank 1 extra MiB | rank 0 / rank 1 held after MiB |",
        "|---|---|---|---|",
    ]
    for case in r["load"]:
        k0, k1 = case["ranks"]
        label = "rank 0" if case["mode"] == "rank0" else "every rank"
        lines.append(
            f"| {label} | {k0['peak_extra_mib']:.0f} | {k1['peak_extra_mib']:.0f} | "
            f"{k0['held_after_mib']:.0f} / {k1['held_after_mib']:.0f} |"
        )
    lines += [
        "",
        f"**Weight sync** to a fake-engine server (its own process) in bfloat16 ({sync0['state_mib']:.0f} MiB "
        "on the wire); the second of two syncs (its seconds: that one sync, the machine loaded by other work; "
        "the side-by-side timing follows the table). *gathered*: the whole state dict gathered on rank 0, then "
        "pushed (the learner before); *streamed*: `WeightPublisher.sync`, a tensor at a time (the learner now).",
        "",
        "| mode | transport | chunk MiB | rank 0 extra MiB | rank 1 extra MiB | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for case in r["sync"]:
        k0, k1 = case["ranks"]
        lines.append(
            f"| {case['mode']} | {case['transport']} | {case['chunk_mib']} | {k0['peak_extra_mib']:.0f} | "
            f"{k1['peak_extra_mib']:.0f} | {k0['seconds']:.2f} |"
        )
    if "sync_timing" in r:
        times = r["sync_timing"]["ranks"][0]["seconds_by_mode"]
        median = {mode: sorted(v)[len(v) // 2 - 1 : len(v) // 2 + 1] for mode, v in times.items()}
        lines += [
            "",
            "Seconds of an http sync (64 MiB chunks), streamed and gathered syncs alternating in one pair of "
            f"ranks ({r['sync_timing'].get('note', 'the same run')}): streamed "
            + ", ".join(f"{t:.2f}" for t in times["streamed"])
            + f" (median {sum(median['streamed']) / 2:.2f}); gathered "
            + ", ".join(f"{t:.2f}" for t in times["gathered"])
            + f" (median {sum(median['gathered']) / 2:.2f}).",
        ]
    lines += [
        "",
        f"**Gradient accumulation**, {r['micro_steps']} micro-steps of {r['tokens']} random tokens per optimizer "
        f"step, {r['steps']} steps (the first, which creates AdamW's state, not counted: extra = the largest "
        "of the others, seconds = their median); each setting run twice, interleaved. *unsharded*: gradients "
        "kept whole until the last micro-step (`set_requires_gradient_sync(False)` before it; the learner "
        "before); *reduce-scatter*: sharded after every micro-step (the learner now).",
        "",
        "| gradients between micro-steps | rank 0 extra MiB | rank 1 extra MiB | s / step rank 0 | s / step rank 1 |",
        "|---|---|---|---|---|",
    ]
    for case in r["accum"]:
        k0, k1 = case["ranks"]
        label = "reduce-scatter" if case["reduce_every_micro_step"] else "unsharded"
        lines.append(
            f"| {label} | {k0['peak_extra_mib']:.0f} | {k1['peak_extra_mib']:.0f} | "
            f"{k0['seconds_per_step']:.1f} | {k1['seconds_per_step']:.1f} |"
        )
    return lines
