"""BENCHMARKS.md's GPU section from a saved `python -m bench gpu` result, and the kernel ladder its rows
follow: plain data and text, no torch (the page is rendered without importing the runner)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The `training.kernels` paths a learner row runs with."""

    fused_linear_cross_entropy: bool = False
    packed_attention: str = "mask"
    liger: bool = False
    compile_blocks: bool = False


# each row adds one path to the row before it (liger and torch.compile cannot be taken off a model again)
LADDER = (
    ("learner", Kernels(), False),
    ("learner_fused_ce", Kernels(True), False),
    ("learner_varlen_lm", Kernels(True, "varlen"), False),
    ("learner_liger", Kernels(True, "varlen", liger=True), False),
    ("learner_compiled", Kernels(True, "varlen", liger=True, compile_blocks=True), False),
    ("learner_compiled_checkpointing", Kernels(True, "varlen", liger=True, compile_blocks=True), True),
)


def summary_text(row: dict[str, Any]) -> str:
    if "error" in row or "skipped" in row:
        return str(row.get("error") or row.get("skipped"))
    mfu = "" if row.get("mfu") is None else f", MFU {row['mfu']:.1%} / {row['mfu_attention_vision']:.1%}"
    return f"{row['tokens_per_s']:,.0f} tokens/s{mfu}"


def markdown(result: dict[str, Any]) -> str:
    """BENCHMARKS.md's GPU section from a saved result (the kernel ladder's, or the run before it)."""
    if not any(key in result for key, _, _ in LADDER[1:]):
        return _markdown_before_kernels(result)
    lines = [
        f"Device: **{result['device']}**, torch {result['torch']}, transformers {result.get('transformers', '?')}. "
        "Qwen2.5-VL-3B-sized model with random weights (3.75 B parameters, 3.09 B in the language model), float32 "
        "masters + bf16 autocast, packs of 4,096 tokens from synthetic 448x448 samples, forward + backward of the "
        "learner's own `PackRunner` (no optimizer step), vision attention one varlen call per layer. Each row adds "
        "one `training.kernels` path to the row above it.",
        "",
        "| learner run | kernels | gradient checkpointing | tokens/s | MFU (ours) | MFU (attention + vision) "
        "| MFU (+ attention over the whole pack) | peak GiB | first steps s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, _, _ in LADDER:
        run = result.get(key)
        if run is None:
            continue
        kernels = run.get("kernels", {})
        on = [name for name, value in kernels.items() if value not in (False, "mask")]
        named = ", ".join(on) or "eager"
        if "tokens_per_s" not in run:
            lines.append(
                f"| {key} | {named} | {run['gradient_checkpointing']} | {summary_text(run)} | | | | | |"
            )
            continue
        lines.append(
            f"| {key} | {named} | {run['gradient_checkpointing']} | {run['tokens_per_s']:,.0f} | {run['mfu']:.1%} "
            f"| {run['mfu_attention_vision']:.1%} | {run['mfu_attention_vision_dense']:.1%} "
            f"| {run['max_memory_allocated_gib']:.1f} | {run['warmup_s']:.0f} |"
        )
    lines.append("")
    for key in ("rollout", "rollout_static"):
        rollout = result.get(key)
        if rollout is None:
            continue
        if "tokens_per_s" in rollout:
            lines.append(
                f"Rollout (`stagectl rollout-server --engine {rollout['engine']}`, kv cache {rollout['kv_cache']}) "
                f"on the same weights in bf16, {rollout['requests']} image requests x {rollout['max_tokens']} "
                f"tokens at temperature 1.0: **{rollout['tokens_per_s']:,.0f} generated tokens/s** "
                f"({rollout['generated_tokens']:,} tokens in {rollout['seconds']:.0f} s)."
            )
        else:
            lines.append(f"Rollout, kv cache {rollout.get('kv_cache')}: {summary_text(rollout)}.")
        lines.append("")
    lines.append(
        "Reading. MFU (ours) counts 6 FLOPs per language-model parameter per token (the LM head only on the rows "
        "the loss reads): no attention, no vision tower, no recompute. MFU (attention + vision) adds the language "
        "model's attention within each segment (12 x layers x hidden x length^2 per segment), the vision tower's "
        "parameters per patch and its windowed / full attention (bench/bench_gpu.py's docstring); the last MFU "
        "column counts the text attention over the whole pack, as torchtitan does for one sequence. "
        "'first steps s' is the warm-up (one pack, three under torch.compile), not in tokens/s."
    )
    return "\n".join(lines)


def _timed_packs(result: dict[str, Any]) -> str:
    """The table's own seconds a pack before and after the varlen vision attention (the profile's figures
    came from another, profiled pass of one pack)."""
    runs = [result.get(key) or {} for key in ("learner_per_window_vision", "learner")]
    if not all("seconds" in run and "tokens_per_s" in run for run in runs):
        return ""
    before, after = (run["seconds"] / run["num_packs_timed"] for run in runs)
    return (
        f"; in the table's timed runs {before:.2f} -> {after:.2f} s a pack, learner tokens/s "
        f"x{runs[1]['tokens_per_s'] / runs[0]['tokens_per_s']:.1f}"
    )


def _markdown_before_kernels(result: dict[str, Any]) -> str:
    """The section of a result saved before the `training.kernels` ladder (2026-11-25)."""
    lines = [
        f"Device: **{result['device']}**, torch {result['torch']}. Qwen2.5-VL-3B-sized model with random weights "
        "(3.75 B parameters, 3.09 B in the language model), float32 masters + bf16 autocast, packs of 4,096 tokens "
        "from synthetic 448x448 samples, forward + backward of the learner's own `PackRunner` (no optimizer step).",
        "",
        "| learner run | vision attention | gradient checkpointing | tokens/s | model TFLOP/s | MFU (lower bound) "
        "| peak GiB |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for key in ("learner_per_window_vision", "learner", "learner_checkpointing"):
        run = result.get(key)
        if run is None:
            continue
        if "out_of_memory" in run:
            lines.append(f"| {key} | | {run['gradient_checkpointing']} | out of memory | | | |")
            continue
        attention = (
            "transformers sdpa, one call per window"
            if run["vision_attention"] == "sdpa"
            else ("one varlen call per layer")
        )
        lines.append(
            f"| {key} | {attention} | {run['gradient_checkpointing']} | {run['tokens_per_s']:,.0f} "
            f"| {run['model_tflops_per_s']:.1f} | {run['mfu']:.1%} | {run['max_memory_allocated_gib']:.1f} |"
        )
    rollout = result.get("rollout", {})
    if "tokens_per_s" in rollout:
        lines += [
            "",
            f"Rollout: `stagectl rollout-server --engine {rollout['engine']}` on the same weights in bf16, "
            f"{rollout['requests']} image requests x {rollout['max_tokens']} tokens at temperature 1.0: "
            f"**{rollout['tokens_per_s']:,.0f} generated tokens/s** ({rollout['generated_tokens']:,} tokens in "
            f"{rollout['seconds']:.0f} s).",
        ]
    elif rollout:
        lines += ["", f"Rollout: {rollout.get('skipped', 'not run')}."]
    lines += [
        "",
        "Reading. MFU counts 6 FLOPs per language-model parameter per token (the LM head only on the rows the "
        "loss reads); the vision tower (~0.6 B parameters over 4,096 patches a pack), attention's quadratic term "
        "and checkpointing's recompute are not counted, so it is a lower bound. It is far below the 40% target. "
        "The LM head runs on the loss's rows only (44% of the tokens here): the session's first run, which "
        "computed float32 logits for every token, went out of memory without checkpointing. "
        "A profile of one pack (`torch.profiler`, same device) found the step launch-bound: transformers' "
        "Qwen2.5-VL vision attention under sdpa loops over windows from Python (~1,900 attention calls a pack, "
        "CPU 1.07 s against 0.44 s of GPU work); the vision tower took 0.43 of a 0.83 s pack. "
        "`stagectl.models.vision_attention` now runs it as one block-diagonal call per layer (PyTorch's flash "
        "`varlen_attn` on CUDA): vision 0.43 -> 0.21 s, the profiled pack 0.83 -> 0.51 s"
        + _timed_packs(result)
        + ". "
        "What is left: the language model alone (4,096 text tokens, one sequence) ran forward + backward in "
        "0.23 s (~31% MFU by the same count; 0.19 s with bf16 parameters instead of autocast), and the vision "
        "tower's remaining 0.21 s is elementwise work and small matmuls. Next steps, not done: fused kernels "
        "(rotary, RMSNorm, SwiGLU, cross-entropy), torch.compile of the decoder layer, flash-attn for the "
        "language model's packed attention. vLLM (no CUDA build on the lent machine; it cannot be carried "
        "there) and two-GPU FSDP (one GPU lent) did not run; the rollout row is transformers' generate, "
        "not vLLM.",
        "",
        "Since this run (issue #45) those next steps are built, each behind a key and tested equal to the eager "
        "path on the CPU, but not yet measured: `training.kernels` (`fused_linear_cross_entropy`, "
        "`packed_attention: varlen`, `compile_blocks`, `liger`) and the hf engine's `rollout_server.hf_kv_cache: "
        "static` (a compiled decode step). `python -m bench gpu` now measures them as a ladder with MFU in two "
        'counts; `bash scripts/gpu_session.sh` (docs/development.md, "A GPU machine without a registry") runs '
        "it with the GPU tier in one device call.",
    ]
    return "\n".join(lines)
