"""`python -m bench gpu`: the learner and the vLLM rollout server at a real size, on one CUDA GPU.

The model is Qwen2.5-VL-3B-sized with random weights (text: hidden 2048, 36 layers, 16 heads, 2 kv heads,
intermediate 11008, vocab 151936, tied head; vision: Qwen2.5-VL-3B's 32-block tower), built from a config
directly on the GPU: nothing is downloaded. (Built under `torch.device("cuda")` rather than on the meta
device and `to_empty`: the rotary `inv_freq` buffers are computed at construction and are not in a state
dict, so a meta build would leave them uninitialised.) The tokenizer and image processor are the tiny
Qwen2.5-VL's (same special-token layout).

- learner: the learner's own forward/backward (`PackRunner.run_batch`: float32 masters, bf16 autocast,
  Channel-A loss, the LM head on the supervised rows only) over packs of `packing_length` 4096 from synthetic
  448x448 samples (collated before the clock starts), no optimizer step; once without and once with
  gradient checkpointing (an out-of-memory is recorded, not raised). tokens/s counts real packed tokens.
  MFU = model FLOPs / s / peak, model FLOPs = 6 * (N - N_head) * tokens + 6 * N_head * head rows, N the
  language model's parameters (the tied embedding / head counted once); the vision tower's FLOPs, attention's
  quadratic FLOPs and checkpointing's recompute are NOT counted, so this MFU is a lower bound. Peak: dense
  bf16 by device name, PEAK_TFLOPS.
- rollout: `stagectl rollout-server` on the same weights in bf16 on the same GPU, image requests, generated
  tokens/s at temperature 1.0: engine vllm where an interpreter imports a CUDA build of vLLM, else the hf
  engine (transformers' generate), named in the result.

On a machine without CUDA it prints one line and returns None (results are left as they were).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from stagectl.models.vision_attention import VARLEN, use_varlen_vision_attention

# Dense bf16 tensor-core peak, TFLOP/s, from the vendors' data sheets (no sparsity). First match wins.
PEAK_TFLOPS = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("A100", 312.0),
               ("L40S", 362.0), ("B200", 2250.0)]  # fmt: skip
TEXT_3B = {"hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
           "intermediate_size": 11008, "vocab_size": 151936, "max_position_embeddings": 32768}  # fmt: skip
VISION_3B = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 2048,
             "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
             "fullatt_block_indexes": [7, 15, 23, 31]}  # fmt: skip
ROOT = Path(__file__).parents[1]


def peak_tflops(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_TFLOPS if key in device_name), None)


def build_3b(bundle: Any, device: str = "cuda") -> PreTrainedModel:
    """A Qwen2.5-VL-3B-sized model with random weights on `device`, the tiny model's token ids."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tiny = bundle.model.config.to_dict()  # keeps the tiny tokenizer's special-token ids
    text = {
        k: v for k, v in tiny["text_config"].items() if k not in ("layer_types", "head_dim")
    }  # re-derived
    text.update(TEXT_3B, tie_word_embeddings=True)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    vision = {**tiny["vision_config"], **VISION_3B}
    ids = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True, **{k: tiny[k] for k in ids}
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    use_varlen_vision_attention(model)  # as load_bundle does
    return model


def learner(
    bundle: Any,
    model: PreTrainedModel,
    packing_length: int,
    num_packs: int,
    device: str = "cuda",
    gradient_checkpointing: bool = False,
) -> dict[str, Any]:
    from stagectl.collate import collate_pack
    from stagectl.data.synthetic import generate_synthetic
    from stagectl.detection.vocab import TokenVocab
    from stagectl.learner.loss import LossWeights, loss_rows
    from stagectl.learner.packs import PackRunner, StepAccumulator
    from stagectl.learner.precision import Precision
    from stagectl.learner.segments import SampleEncoder
    from stagectl.packing import pack_segments

    samples = generate_synthetic(24 * (num_packs + 1), seed=7, image_size=448, max_objects=8)
    big = dataclasses.replace(bundle, model=model)
    encoder = SampleEncoder(bundle=big, samples=samples, vocab=TokenVocab.from_tokenizer(bundle.tokenizer))
    segments = [encoder.channel_a_segment(i) for i in range(len(samples))]
    groups = pack_segments([len(s) for s in segments], packing_length)[: num_packs + 1]  # the fullest first
    packs = [collate_pack([segments[i] for i in group], model) for group in groups]
    runner = PackRunner(
        ddp_model=model, base_model=model, loss_weights=LossWeights(),
        coord_token_ids=torch.tensor(bundle.coord_token_ids, device=device), packing_length=packing_length,
        device=torch.device(device), precision=Precision(torch.float32, torch.bfloat16, torch.bfloat16, False),
    )  # fmt: skip
    model.train()
    if gradient_checkpointing:  # what training.gradient_checkpointing does (stagectl/learner/setup.py)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    torch.cuda.reset_peak_memory_stats() if device == "cuda" else None
    runner.run_batch(packs[0], scale=1.0, sync=True, acc=StepAccumulator())  # warm-up (kernels, allocator)
    model.zero_grad(set_to_none=True)
    _synchronize(device)
    started = time.perf_counter()
    for pack in packs[1:]:
        runner.run_batch(pack, scale=1.0, sync=True, acc=StepAccumulator())
    _synchronize(device)
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)  # 15 GB of float32 gradients the vLLM half needs back
    tokens = sum(p.num_tokens for p in packs[1:])
    head_rows = sum(int(loss_rows(p.ce_weights, p.coord_positions).numel()) for p in packs[1:])
    lm_params = sum(p.numel() for n, p in model.named_parameters() if "visual" not in n)
    head_params = model.get_output_embeddings().weight.numel()  # tied: the embedding matrix, counted once
    # 6 FLOPs per parameter per token, the LM head only on the rows the loss reads (the learner skips the rest)
    model_flops = 6 * (lm_params - head_params) * tokens + 6 * head_params * head_rows
    peak = peak_tflops(torch.cuda.get_device_name()) if device == "cuda" else None
    return {
        "gradient_checkpointing": gradient_checkpointing,
        "params_total": sum(p.numel() for p in model.parameters()),
        "params_counted_for_mfu": lm_params,
        "packing_length": packing_length,
        "num_packs_timed": len(packs) - 1,
        "tokens_timed": tokens,
        "head_rows_timed": head_rows,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "peak_bf16_tflops": peak,
        "model_tflops_per_s": model_flops / seconds / 1e12,
        "mfu": None if peak is None else model_flops / seconds / (peak * 1e12),
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _vllm_python() -> str | None:
    venv = Path(os.environ.get("STAGECTL_VLLM_VENV", str(ROOT / ".venv-vllm")))
    for python in (venv / "bin" / "python", Path(sys.executable)):
        probe = "import torch, vllm; raise SystemExit(0 if torch.cuda.is_available() else 3)"
        if (
            python.is_file()
            and subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0
        ):
            return str(python)
    return None


def rollout(engine: str, python: str, checkpoint: Path, num_requests: int, max_tokens: int) -> dict[str, Any]:
    from PIL import Image

    from stagectl.rollout.client import RolloutClient, to_generation
    from stagectl.rollout.protocol import RequestConfig
    from stagectl.rollout.requests import detection_request
    from stagectl.rollout.server.launcher import ServerProcess

    images = checkpoint / "images"
    images.mkdir()
    paths = []
    for k in range(8):
        path = images / f"{k}.png"
        Image.new("RGB", (448, 448), (30 * k, 100, 200)).save(path)
        paths.append(path)
    argv = [
        python,
        "-m",
        "stagectl",
        "rollout-server",
        "--engine",
        engine,
        "--port",
        "0",
        "--model",
        str(checkpoint),
    ]
    for setting in (f"image_roots=[{images}]", "vllm.dtype=bfloat16", "vllm.max_model_len=4096",
                    f"max_batch_size={num_requests}"):  # fmt: skip
        argv += ["--set", f"rollout_server.{setting}"]
    argv += ["--set", "model.torch_dtype=bfloat16"]  # the hf engine's dtype
    server = ServerProcess(argv, cwd=ROOT)
    try:
        server.wait_listening(timeout_s=900)
        assert server.url is not None
        config = RequestConfig(max_tokens=max_tokens, temperature=1.0, seed=0, return_details=True)
        requests = [
            detection_request([paths[k % len(paths)]], "Find every object.") for k in range(num_requests)
        ]
        with RolloutClient([server.url]) as client:
            client.wait_healthy(timeout_s=120)
            client.infer(requests[:8], config)  # warm-up
            started = time.perf_counter()
            outs = client.infer(requests, config)
            seconds = time.perf_counter() - started
        generated = sum(len(to_generation(out).token_ids) for out in outs)
        return {"engine": engine, "requests": num_requests, "max_tokens": max_tokens, "generated_tokens": generated,
                "seconds": seconds, "tokens_per_s": generated / seconds}  # fmt: skip
    finally:
        server.stop()


def run(packing_length: int = 4096, num_packs: int = 8, num_requests: int = 64, max_tokens: int = 256) -> Any:
    if not torch.cuda.is_available():
        print(
            "bench gpu: needs CUDA (torch.cuda.is_available() is False here); skipped, results left unchanged"
        )
        return None
    from stagectl.models.loading import load_bundle

    bundle = load_bundle("builtin:tiny-qwen2.5-vl")
    model = build_3b(bundle)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    vision = model.config.vision_config
    runs = (("learner_per_window_vision", "sdpa", False), ("learner", VARLEN, False),
            ("learner_checkpointing", VARLEN, True))  # fmt: skip
    for key, vision_attention, checkpointing in runs:
        vision._attn_implementation = vision_attention  # transformers' per-window loop, or one call per layer
        try:
            result[key] = learner(
                bundle, model, packing_length, num_packs, gradient_checkpointing=checkpointing
            )
            result[key]["vision_attention"] = vision_attention
        except torch.OutOfMemoryError as error:
            model.zero_grad(set_to_none=True)
            result[key] = {"gradient_checkpointing": checkpointing, "out_of_memory": str(error).split(".")[0]}
        torch.cuda.empty_cache()
    python = _vllm_python()
    engine = "hf" if python is None else "vllm"  # no CUDA build of vLLM here: transformers on the GPU
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp)
        torch.nn.Module.to(
            model, torch.bfloat16
        )  # what the rollout server serves (transformers types `.to` oddly)
        model.save_pretrained(checkpoint)
        del model
        torch.cuda.empty_cache()
        bundle.tokenizer.save_pretrained(checkpoint)
        assert bundle.image_processor is not None  # the tiny Qwen2.5-VL has one
        bundle.image_processor.save_pretrained(checkpoint)
        result["rollout"] = rollout(engine, python or sys.executable, checkpoint, num_requests, max_tokens)
    return result


def markdown(result: dict[str, Any]) -> str:
    """BENCHMARKS.md's GPU section from a saved result."""
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
        "`varlen_attn` on CUDA): vision 0.43 -> 0.21 s, the pack 0.83 -> 0.51 s, learner tokens/s x2.6 above. "
        "What is left: the language model alone (4,096 text tokens, one sequence) ran forward + backward in "
        "0.23 s (~31% MFU by the same count; 0.19 s with bf16 parameters instead of autocast), and the vision "
        "tower's remaining 0.21 s is elementwise work and small matmuls. Next steps, not done: fused kernels "
        "(rotary, RMSNorm, SwiGLU, cross-entropy), torch.compile of the decoder layer, flash-attn for the "
        "language model's packed attention. vLLM (no CUDA build on the lent machine; it cannot be carried "
        "there) and two-GPU FSDP (one GPU lent) did not run; the rollout row is transformers' generate, "
        "not vLLM.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
