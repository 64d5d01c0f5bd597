"""The learner on CUDA: packed == unpacked logits under bf16 autocast (sdpa, and flash-attn where installed),
a train-ab run with `mixed_precision: bf16` against a float32 CPU run of the same config, and
`parallelism: fsdp` against ddp on two GPUs (nccl). One end-to-end run per topology."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from stagectl.collate import collate_pack
from stagectl.models.loading import load_bundle
from tests.gpu.helpers import cpu_only_env, require_attn, require_gpus
from tests.helpers import image_segments, single_logits
from tests.integration.helpers import read_metrics, run_cli, tiny_train_config, write_config

ATTNS = ["sdpa", "flash_attention_2"]
# bf16 logits of the tiny model (|logits| ~ 1) are ~0.007 off float32 (measured on CPU autocast); a packing
# bug (segments attending to each other, positions not restarting) moves them by ~1.
# Losses of a 3-step tiny run, bf16 autocast against float32, differ by < 1e-4 relative (measured on CPU).
BF16_ATOL = 0.05
BF16_LOSS_REL = 5e-3


@pytest.mark.parametrize("attn", ATTNS)
def test_packed_logits_equal_unpacked_in_bf16(attn: str) -> None:
    require_attn(attn)
    bundle = load_bundle("builtin:tiny-qwen2.5-vl", device="cuda", attn_implementation=attn)
    model = bundle.model  # float32 masters, bf16 compute: what training.mixed_precision: bf16 runs
    segments = image_segments(bundle)
    batch = collate_pack(segments, model).to("cuda")
    with torch.no_grad():
        references = [single_logits(model, s, "cuda") for s in segments]  # float32, each segment alone
        with torch.autocast("cuda", dtype=torch.bfloat16):
            packed = model(**batch.model_inputs()).logits[0].float()
            broken_inputs = batch.model_inputs()
            broken_inputs["position_ids"] = batch.position_ids[1:]  # type: ignore[index]  # positions not restarting
            broken = model(**broken_inputs).logits[0].float()
    starts = batch.segment_starts
    for segment, start, reference in zip(segments, starts, references, strict=True):
        got = packed[start : start + len(segment)]
        torch.testing.assert_close(got, reference, atol=BF16_ATOL, rtol=0)
    # The check can fail: the later segments differ by far more than bf16 noise when packing is wrong.
    later = references[1]
    assert (broken[starts[1] : starts[1] + len(segments[1])] - later).abs().max() > 5 * BF16_ATOL


def _a_only(tmp_path: Path, name: str, **training: object) -> dict:
    return tiny_train_config(
        tmp_path,
        training={"max_steps": 3, "output_dir": str(tmp_path / name), **training},
        stage2_ab={"schedule": {"b_ratio": 0.0}, "channel_b": {"mode": "step"}},
    )


def _train(tmp_path: Path, cfg: dict, env: dict[str, str] | None = None) -> list[dict]:
    path = write_config(tmp_path / f"{Path(cfg['training']['output_dir']).name}.yaml", cfg)
    result = run_cli("train-ab", str(path), timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return read_metrics(Path(cfg["training"]["output_dir"]))


@pytest.fixture(scope="module")
def cpu_float32(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp_path = tmp_path_factory.mktemp("cpu")
    return _train(tmp_path, _a_only(tmp_path, "cpu"), env=cpu_only_env())


@pytest.mark.parametrize("attn", ATTNS)
def test_train_ab_bf16_on_gpu_matches_float32_on_cpu(
    attn: str, cpu_float32: list[dict], tmp_path: Path
) -> None:
    require_attn(attn)
    cfg = _a_only(tmp_path, "gpu", mixed_precision="bf16")
    cfg["model"]["attn_implementation"] = attn
    rows = _train(tmp_path, cfg)
    assert [r["step"] for r in rows] == [r["step"] for r in cpu_float32] == [0, 1, 2]
    for gpu, cpu in zip(rows, cpu_float32, strict=True):
        assert math.isfinite(gpu["loss"]) and math.isfinite(gpu["grad_norm"])
        assert gpu["loss"] == pytest.approx(cpu["loss"], rel=BF16_LOSS_REL), (
            gpu["step"],
            gpu["loss"],
            cpu["loss"],
        )
        # float32 masters under bf16 compute: the optimizer moves as many elements as in float32
        assert gpu["optim/update_nonzero_frac"] == pytest.approx(cpu["optim/update_nonzero_frac"], abs=0.01)


def test_fsdp_on_two_gpus_trains_the_same_losses_as_ddp(tmp_path: Path) -> None:
    require_gpus(2)
    launch = {"launch": {"nproc_per_node": 2, "watchdog": {"step_s": 120}}}
    ddp = _train(tmp_path, {**_a_only(tmp_path, "ddp", mixed_precision="bf16"), **launch})
    fsdp = _train(
        tmp_path,
        {**_a_only(tmp_path, "fsdp", mixed_precision="bf16", parallelism="fsdp", save_steps=3), **launch},
    )
    assert [r["step"] for r in fsdp] == [0, 1, 2]
    for a, b in zip(ddp, fsdp, strict=True):
        # bf16 both; ddp autocasts, fsdp casts through MixedPrecisionPolicy: equal within bf16 tolerance
        assert b["loss"] == pytest.approx(a["loss"], rel=BF16_LOSS_REL), (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=0.05)
    assert (tmp_path / "fsdp" / "checkpoint-3" / "train_state").is_dir()  # a DCP checkpoint, sharded


def test_vision_attention_in_one_call_equals_the_per_window_loop_in_bf16() -> None:
    """On CUDA in bf16 the vision tower's attention is PyTorch's flash `varlen_attn` (one call per layer);
    transformers' sdpa loop over windows is the reference, forward and backward."""
    from stagectl.models import vision_attention

    bundle = load_bundle("builtin:tiny-qwen2.5-vl", device="cuda")
    model, vision = bundle.model, bundle.model.config.vision_config
    assert vision._attn_implementation == vision_attention.VARLEN
    assert vision_attention._torch_varlen() is not None, "this torch has no torch.nn.attention.varlen"
    batch = collate_pack(image_segments(bundle), model).to("cuda")
    results = []
    for implementation in (vision_attention.VARLEN, "sdpa"):
        vision._attn_implementation = implementation
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(**batch.model_inputs()).logits.float()
        logits.logsumexp(-1).mean().backward()
        grad = model.model.visual.blocks[0].attn.qkv.weight.grad.clone()
        results.append((logits.detach(), grad))
    (got, got_grad), (want, want_grad) = results
    torch.testing.assert_close(got, want, atol=BF16_ATOL, rtol=0)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-3, rtol=0.05)
