"""`python -m bench gpu` off a GPU, and its peak-FLOPs table (MFU's denominator) by device name."""

from __future__ import annotations

import pytest
import torch

from bench.bench_gpu import peak_tflops, run


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),  # SXM
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Tesla T4", None),  # unknown: no MFU rather than a wrong one
    ],
)
def test_peak_tflops_by_device_name(name: str, peak: float | None) -> None:
    assert peak_tflops(name) == peak


def test_without_cuda_it_says_so_and_measures_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run() is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "needs CUDA" in out[0]


def test_learner_rows_and_both_flop_counts_on_the_cpu() -> None:
    """The GPU session's learner row, run on the CPU with the tiny model: the kernel paths plug in, and the
    attention + vision count adds to ours exactly the terms the docstring names."""
    from bench.bench_gpu import build_packs, learner, model_flops
    from stagectl.collate import collate_pack
    from stagectl.models import speedups
    from stagectl.models.loading import load_bundle
    from tests.helpers import image_segments

    bundle = load_bundle("builtin:tiny-qwen2.5-vl")
    model = bundle.model
    speedups.apply_speedups(
        model, torch.device("cpu"), liger=False, packed_attention="varlen", torch_compile=False
    )
    packs = build_packs(bundle, model, 512, 2, image_size=56)
    row = learner(bundle, model, packs, 512, device="cpu", fused_linear_cross_entropy=True)
    assert row["tokens_timed"] > 0 and row["tokens_per_s"] > 0 and row["mfu"] is None  # no peak on a CPU
    assert row["tflops_per_s_attention_vision"] > row["model_tflops_per_s"]
    pack = collate_pack(image_segments(bundle), model)
    counts = model_flops(model, [pack], head_rows=10)
    lm_params = sum(p.numel() for n, p in model.named_parameters() if "visual" not in n)
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert embed is not head  # the tiny model's head is untied: its input embedding is a lookup, no FLOPs
    body = lm_params - head.numel() - embed.numel()
    assert counts["ours"] == 6 * body * pack.num_tokens + 6 * head.numel() * 10
    text = model.config.get_text_config()
    attention = 12 * text.num_hidden_layers * text.hidden_size * sum(n * n for n in pack.segment_lengths)
    dense = 12 * text.num_hidden_layers * text.hidden_size * pack.num_tokens**2
    vision_flops = counts["attention_vision"] - counts["ours"] - attention
    assert vision_flops > 0
    assert counts["attention_vision_dense"] - counts["ours"] - dense == pytest.approx(vision_flops)
    patches = int(pack.image_grid_thw.prod(-1).sum())  # type: ignore[union-attr]
    visual_params = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    assert 6 * visual_params * patches / 4 < vision_flops  # at least every parameter on every merged token


def test_markdown_names_failed_and_skipped_rows() -> None:
    from bench.markdown_gpu import LADDER, markdown

    ok = {"kernels": {"fused_linear_cross_entropy": False, "packed_attention": "mask", "liger": False,
                      "compile_blocks": False}, "gradient_checkpointing": False, "tokens_per_s": 7864.0,
          "mfu": 0.139, "mfu_attention_vision": 0.2, "mfu_attention_vision_dense": 0.17,
          "max_memory_allocated_gib": 69.4, "warmup_s": 3.0}  # fmt: skip
    result = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", LADDER[0][0]: ok,
              LADDER[1][0]: {**ok, "error": "OutOfMemoryError: CUDA out of memory"}, LADDER[3][0]:
              {"kernels": {"liger": True}, "gradient_checkpointing": False, "skipped": "liger missing"},
              "rollout_static": {"engine": "hf", "kv_cache": "static", "error": "RuntimeError: boom"}}  # fmt: skip
    del result[LADDER[1][0]]["tokens_per_s"]
    text = markdown(result)
    assert "| learner | eager | False | 7,864 | 13.9% | 20.0% | 17.0% | 69.4 | 3 |" in text
    assert "OutOfMemoryError: CUDA out of memory" in text and "liger missing" in text
    assert "Rollout, kv cache static: RuntimeError: boom." in text


def test_the_ladder_skips_only_liger_s_own_row_without_liger() -> None:
    from bench.bench_gpu import LADDER, plan_ladder

    with_liger = plan_ladder(None)
    assert [row[0] for row in with_liger] == [key for key, _, _ in LADDER] and all(
        r[3] is None for r in with_liger
    )
    without = plan_ladder("liger missing")
    skipped = [row[0] for row in without if row[3] is not None]
    assert skipped == ["learner_liger"]
    compiled = dict((row[0], row[1]) for row in without)["learner_compiled"]
    assert compiled.compile_blocks and compiled.fused_linear_cross_entropy and not compiled.liger


def test_the_run_before_the_ladder_reads_its_own_seconds_a_pack() -> None:
    """The section of a result saved before the kernel ladder: the profile's pack times (0.83 -> 0.51 s)
    sit beside the table's own timed runs, which give its tokens/s ratio (the recorded run: 1.33 -> 0.51 s
    a pack, x2.6, where the profile's figures alone read as 1.6x)."""
    from bench.markdown_gpu import markdown

    def learner(vision: str, seconds: float) -> dict[str, object]:
        tokens = 8 * 4000
        return {
            "gradient_checkpointing": False,
            "num_packs_timed": 8,
            "tokens_timed": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "model_tflops_per_s": 1.0,
            "mfu": 0.01,
            "max_memory_allocated_gib": 1.0,
            "vision_attention": vision,
        }

    result = {
        "device": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0",
        "learner_per_window_vision": learner("sdpa", 12.0),
        "learner": learner("stagectl_flash_varlen_vision", 4.0),
    }
    text = markdown(result)
    assert (
        "the profiled pack 0.83 -> 0.51 s; in the table's timed runs 1.50 -> 0.50 s a pack, learner tokens/s x3.0."
        in text
    )
    del result["learner_per_window_vision"]
    assert "the profiled pack 0.83 -> 0.51 s. What is left" in markdown(result)
