"""`python -m bench gpu`: the learner and the vLLM rollout server at a real size, on one CUDA GPU.

The model is Qwen2.5-VL-3B-sized with random weights (text: hidden 2048, 36 layers, 16 heads, 2 kv heads,
intermediate 11008, vocab 151936, tied head; vision: Qwen2.5-VL-3B's 32-block tower), built from a config
directly on the GPU: nothing is downloaded. (Built under `torch.device("cuda")` rather than on the meta
device and `to_empty`: the rotary `inv_freq` buffers are computed at construction and are not in a state
dict, so a meta build would leave them uninitialised.) The tokenizer and image processor are the tiny
Qwen2.5-VL's (same special-token layout).

- learner: the learner's own forward/backward (`PackRunner.run_batch`: float32 masters, bf16 autocast,
  Channel-A loss) over packs of `packing_length` 4096 from synthetic 448x448 samples (collated before the clock starts), no
  optimizer step.
  tokens/s counts real packed tokens. MFU = 6 * N * tokens/s / peak, N = language-model parameters (the tied
  head counted once, so its matmul is counted); the vision tower's FLOPs and attention's
  (quadratic) FLOPs are NOT counted, so this MFU is a lower bound. Peak: dense bf16 by device name, PEAK_TFLOPS.
- vllm: `stagectl rollout-server --engine vllm` on the same checkpoint (bf16) and GPU, image requests,
  generated tokens/s at temperature 1.0 (needs an interpreter that imports a CUDA build of vLLM).

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
    return model


def learner(
    bundle: Any, model: PreTrainedModel, packing_length: int, num_packs: int, device: str = "cuda"
) -> dict[str, Any]:
    from stagectl.collate import collate_pack
    from stagectl.data.synthetic import generate_synthetic
    from stagectl.detection.vocab import TokenVocab
    from stagectl.learner.loss import LossWeights
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
    lm_params = sum(p.numel() for n, p in model.named_parameters() if "visual" not in n)
    peak = peak_tflops(torch.cuda.get_device_name()) if device == "cuda" else None
    tokens_per_s = tokens / seconds
    return {
        "params_total": sum(p.numel() for p in model.parameters()),
        "params_counted_for_mfu": lm_params,
        "packing_length": packing_length,
        "num_packs_timed": len(packs) - 1,
        "tokens_timed": tokens,
        "tokens_per_s": tokens_per_s,
        "peak_bf16_tflops": peak,
        "mfu": None if peak is None else 6 * lm_params * tokens_per_s / (peak * 1e12),
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


def vllm_rollout(checkpoint: Path, num_requests: int, max_tokens: int) -> dict[str, Any]:
    from PIL import Image

    from stagectl.rollout.client import RolloutClient, to_generation
    from stagectl.rollout.launcher import ServerProcess
    from stagectl.rollout.protocol import RequestConfig
    from stagectl.rollout.requests import detection_request

    python = _vllm_python()
    if python is None:
        return {"skipped": "no interpreter here imports a CUDA build of vLLM"}
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
        "vllm",
        "--port",
        "0",
        "--model",
        str(checkpoint),
    ]
    for setting in (f"image_roots=[{images}]", "vllm.dtype=bfloat16", "vllm.max_model_len=4096",
                    f"max_batch_size={num_requests}"):  # fmt: skip
        argv += ["--set", f"rollout_server.{setting}"]
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
        return {"requests": num_requests, "max_tokens": max_tokens, "generated_tokens": generated,
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
    result["learner"] = learner(bundle, model, packing_length, num_packs)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp)
        torch.nn.Module.to(model, torch.bfloat16)  # what vLLM serves (transformers types `.to` oddly)
        model.save_pretrained(checkpoint)
        del model
        torch.cuda.empty_cache()
        bundle.tokenizer.save_pretrained(checkpoint)
        assert bundle.image_processor is not None  # the tiny Qwen2.5-VL has one
        bundle.image_processor.save_pretrained(checkpoint)
        result["vllm"] = vllm_rollout(checkpoint, num_requests, max_tokens)
    return result


if __name__ == "__main__":
    print(run())
