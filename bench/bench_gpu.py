"""`python -m bench gpu`: the learner and the rollout server at a real size, on one CUDA GPU.

The model is Qwen2.5-VL-3B-sized with random weights (text: hidden 2048, 36 layers, 16 heads, 2 kv heads,
intermediate 11008, vocab 151936, tied head; vision: Qwen2.5-VL-3B's 32-block tower), built from a config
directly on the GPU: nothing is downloaded. (Built under `torch.device("cuda")` rather than on the meta
device and `to_empty`: the rotary `inv_freq` buffers are computed at construction and are not in a state
dict, so a meta build would leave them uninitialised.) The tokenizer and image processor are the tiny
Qwen2.5-VL's (same special-token layout).

- learner: the learner's own forward/backward (`PackRunner.run_batch`: float32 masters, bf16 autocast,
  Channel-A loss, the LM head on the supervised rows only) over packs of `packing_length` 4096 from synthetic
  448x448 samples (collated before the clock starts), no optimizer step. One row per step of a ladder of
  `training.kernels` paths, each row adding one to the last (liger and torch.compile cannot be taken off a
  model again): eager, + fused linear cross-entropy, + varlen packed attention, + liger (where liger-kernel
  imports), + torch.compile per block, and that last one with gradient checkpointing. A row that fails
  (out of memory, a kernel error) is recorded with its error and the ladder goes on. tokens/s counts real
  packed tokens.
  MFU, two counts, over the dense bf16 peak by device name (PEAK_TFLOPS):
  * ours: 6 * (N - N_head) * tokens + 6 * N_head * head rows, N the language model's parameters (the tied
    embedding / head counted once; an untied input embedding, a lookup, not at all): no attention, no
    vision tower, no recompute (a lower bound);
  * attention + vision: ours plus the language model's attention, 12 * layers * hidden * sum over segments
    of length^2 (each segment attends to itself only: what the block-diagonal mask or varlen leaves to do;
    the causal half not discounted, as PaLM / torchtitan count), the vision tower's parameters at 6 FLOPs per
    patch (the merger per merged token), and its attention, 12 * hidden * sum of piece length^2 per block
    (windows of (window_size / patch_size)^2 patches, whole images in the full-attention blocks).
    `mfu_attention_vision_dense` is the same with torchtitan's text attention count, which takes the whole
    pack as the sequence (12 * layers * hidden * pack length per token).
- rollout: `stagectl rollout-server` on the same weights in bf16 on the same GPU, image requests, generated
  tokens/s at temperature 1.0: engine vllm where an interpreter imports a CUDA build of vLLM, else the hf
  engine (transformers' generate), once per `rollout_server.hf_kv_cache` (dynamic, static).

Each finished row is also written to `$BENCH_GPU_PARTIAL` when that is set (scripts/gpu_session.sh), so a
session cut short keeps what it measured. On a machine without CUDA it prints one line and returns None
(results are left as they were).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from bench.markdown_gpu import LADDER, Kernels, summary_text
from stagectl.models import speedups
from stagectl.models.vision_attention import use_varlen_vision_attention

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


def build_packs(
    bundle: Any, model: PreTrainedModel, packing_length: int, count: int, image_size: int = 448
) -> list[Any]:
    """`count` Channel-A packs of synthetic samples, the fullest first, collated once for every row."""
    from stagectl.collate import collate_pack
    from stagectl.data.synthetic import generate_synthetic
    from stagectl.detection.vocab import TokenVocab
    from stagectl.learner.segments import SampleEncoder
    from stagectl.packing import pack_segments

    samples = generate_synthetic(24 * count, seed=7, image_size=image_size, max_objects=8)
    big = dataclasses.replace(bundle, model=model)
    encoder = SampleEncoder(bundle=big, samples=samples, vocab=TokenVocab.from_tokenizer(bundle.tokenizer))
    segments = [encoder.channel_a_segment(i) for i in range(len(samples))]
    groups = pack_segments([len(s) for s in segments], packing_length)[:count]
    return [collate_pack([segments[i] for i in group], model) for group in groups]


def learner(
    bundle: Any,
    model: PreTrainedModel,
    packs: list[Any],
    packing_length: int,
    device: str = "cuda",
    gradient_checkpointing: bool = False,
    fused_linear_cross_entropy: bool = False,
    num_warmup: int = 1,
) -> dict[str, Any]:
    """One row: the first `num_warmup` of `packs` untimed, the rest timed."""
    from stagectl.config.plan_train import LossWeights
    from stagectl.learner.loss import loss_rows
    from stagectl.learner.packs import PackRunner, StepAccumulator
    from stagectl.learner.precision import Precision

    compute = torch.bfloat16 if device == "cuda" else None  # CPU (the unit test): float32, no autocast
    runner = PackRunner(
        ddp_model=model, base_model=model, loss_weights=LossWeights(),
        coord_token_ids=torch.tensor(bundle.coord_token_ids, device=device), packing_length=packing_length,
        device=torch.device(device), precision=Precision(torch.float32, compute, torch.bfloat16, False),
        fused_linear_cross_entropy=fused_linear_cross_entropy,
    )  # fmt: skip
    model.train()
    if gradient_checkpointing:  # what training.gradient_checkpointing does (stagectl/learner/setup.py)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    torch.cuda.reset_peak_memory_stats() if device == "cuda" else None
    _synchronize(device)
    started = time.perf_counter()
    for pack in packs[:num_warmup]:  # kernels, the allocator, torch.compile's first traces
        runner.run_batch(pack, scale=1.0, sync=True, acc=StepAccumulator())
    model.zero_grad(set_to_none=True)
    _synchronize(device)
    warmup_s = time.perf_counter() - started
    timed = packs[num_warmup:]
    started = time.perf_counter()
    for pack in timed:
        runner.run_batch(pack, scale=1.0, sync=True, acc=StepAccumulator())
    _synchronize(device)
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)  # 15 GB of float32 gradients the rollout half needs back
    tokens = sum(p.num_tokens for p in timed)
    head_rows = sum(int(loss_rows(p.ce_weights, p.coord_positions).numel()) for p in timed)
    flops = model_flops(model, timed, head_rows)
    peak = peak_tflops(torch.cuda.get_device_name()) if device == "cuda" else None

    def mfu(count: float) -> float | None:
        return None if peak is None else count / seconds / (peak * 1e12)

    return {
        "gradient_checkpointing": gradient_checkpointing,
        "params_total": sum(p.numel() for p in model.parameters()),
        "params_counted_for_mfu": flops["lm_params"],
        "packing_length": packing_length,
        "num_packs_timed": len(timed),
        "tokens_timed": tokens,
        "head_rows_timed": head_rows,
        "warmup_s": warmup_s,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "peak_bf16_tflops": peak,
        "model_tflops_per_s": flops["ours"] / seconds / 1e12,
        "mfu": mfu(flops["ours"]),
        "tflops_per_s_attention_vision": flops["attention_vision"] / seconds / 1e12,
        "mfu_attention_vision": mfu(flops["attention_vision"]),
        "mfu_attention_vision_dense": mfu(flops["attention_vision_dense"]),
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }


def model_flops(model: Any, packs: list[Any], head_rows: int) -> dict[str, float]:
    """Training FLOPs of forward + backward over `packs` in the two counts of the module docstring."""
    text = model.config.get_text_config()
    lm_params = sum(p.numel() for n, p in model.named_parameters() if "visual" not in n)
    head = model.get_output_embeddings().weight
    head_params = head.numel()  # tied: the embedding matrix, counted once
    embed = model.get_input_embeddings().weight
    lookup_params = 0 if embed is head else embed.numel()  # an untied input embedding is a lookup: no FLOPs
    tokens = sum(p.num_tokens for p in packs)
    # 6 FLOPs per parameter per token, the LM head only on the rows the loss reads (the learner skips the rest)
    ours = 6 * (lm_params - head_params - lookup_params) * tokens + 6 * head_params * head_rows
    width = text.num_attention_heads * (text.hidden_size // text.num_attention_heads)
    per_segment = sum(12 * text.num_hidden_layers * width * n * n for p in packs for n in p.segment_lengths)
    dense = sum(12 * text.num_hidden_layers * width * p.num_tokens * p.num_tokens for p in packs)
    vision_flops = 0.0
    vision = getattr(model.config, "vision_config", None)
    if vision is not None:
        merge = vision.spatial_merge_size**2
        merger = sum(p.numel() for n, p in model.named_parameters() if "visual.merger" in n)
        tower = sum(p.numel() for n, p in model.named_parameters() if "visual" in n) - merger
        window = (getattr(vision, "window_size", 0) // vision.patch_size) ** 2  # patches per window
        full_blocks = len(getattr(vision, "fullatt_block_indexes", []) or []) if window else vision.depth
        for pack in packs:
            if pack.image_grid_thw is None:
                continue
            for t, h, w in pack.image_grid_thw.tolist():
                n = t * h * w  # patches of one image
                vision_flops += 6 * tower * n + 6 * merger * n / merge
                pieces = full_blocks * n * n + (vision.depth - full_blocks) * n * min(n, window)
                vision_flops += 12 * vision.hidden_size * pieces
    return {"lm_params": lm_params, "ours": ours, "attention_vision": ours + per_segment + vision_flops,
            "attention_vision_dense": ours + dense + vision_flops}  # fmt: skip


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


def rollout(
    engine: str, python: str, checkpoint: Path, num_requests: int, max_tokens: int, kv_cache: str = "dynamic"
) -> dict[str, Any]:
    from PIL import Image

    from stagectl.inference.client import RolloutClient, to_generation
    from stagectl.inference.requests import detection_request
    from stagectl.server.launcher import ServerProcess
    from stagectl.wire.protocol import RequestConfig

    images = checkpoint / "images"
    images.mkdir(exist_ok=True)
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
                    f"max_batch_size={num_requests}", f"hf_kv_cache={kv_cache}"):  # fmt: skip
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
        return {"engine": engine, "kv_cache": kv_cache, "requests": num_requests, "max_tokens": max_tokens,
                "generated_tokens": generated, "seconds": seconds, "tokens_per_s": generated / seconds}  # fmt: skip
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
    result["transformers"] = __import__("transformers").__version__
    device = torch.device("cuda")
    packs = build_packs(bundle, model, packing_length, num_packs + 3)  # up to 3 warm-up packs, then num_packs
    applied = Kernels()
    for key, kernels, checkpointing, skipped in plan_ladder(speedups.liger_problem(device)):
        row: dict[str, Any] = {
            "kernels": dataclasses.asdict(kernels),
            "gradient_checkpointing": checkpointing,
        }
        if skipped is not None:
            row["skipped"] = skipped
        else:
            try:
                speedups.apply_speedups(
                    model, device, liger=kernels.liger and not applied.liger,
                    packed_attention=kernels.packed_attention if applied.packed_attention == "mask" else "mask",
                    torch_compile=kernels.compile_blocks and not applied.compile_blocks,
                )  # fmt: skip
                applied = kernels
                warmup = 3 if kernels.compile_blocks else 1  # torch.compile traces the first shapes
                row.update(
                    learner(bundle, model, packs[3 - warmup :], packing_length, gradient_checkpointing=checkpointing,
                            fused_linear_cross_entropy=kernels.fused_linear_cross_entropy, num_warmup=warmup)
                )  # fmt: skip
            except Exception as error:  # recorded in the results and printed: the next rows still run
                model.zero_grad(set_to_none=True)
                row["error"] = _error_text(error)
        print(f"bench gpu: {key}: {summary_text(row)}", flush=True)
        result[key] = row
        _save_partial(result)
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
        caches = ("static", "dynamic") if engine == "hf" else ("dynamic",)  # the new path first
        for kv_cache in caches:
            key = "rollout" if kv_cache == "dynamic" else f"rollout_{kv_cache}"
            try:
                result[key] = rollout(
                    engine, python or sys.executable, checkpoint, num_requests, max_tokens, kv_cache
                )
            except Exception as error:  # recorded; the other engine row still runs
                result[key] = {"engine": engine, "kv_cache": kv_cache, "error": _error_text(error)}
            print(f"bench gpu: {key}: {summary_text(result[key])}", flush=True)
            _save_partial(result)
    return result


def plan_ladder(liger_missing: str | None) -> list[tuple[str, Kernels, bool, str | None]]:
    """LADDER as it runs here: (key, kernels, gradient checkpointing, why the row is skipped or None). Without
    liger-kernel its own row is skipped and the rows after it run without it."""
    plan: list[tuple[str, Kernels, bool, str | None]] = []
    previous = Kernels()
    for key, wanted, checkpointing in LADDER:
        kernels = dataclasses.replace(wanted, liger=wanted.liger and liger_missing is None)
        adds_liger = wanted.liger and not previous.liger  # the row whose one addition is liger
        plan.append((key, kernels, checkpointing, liger_missing if adds_liger and liger_missing else None))
        previous = wanted
    return plan


def _error_text(error: BaseException) -> str:
    first_line = (str(error).splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line}"[:300]


def _save_partial(result: dict[str, Any]) -> None:
    path = os.environ.get("BENCH_GPU_PARTIAL")
    if path:
        Path(path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    print(run())
