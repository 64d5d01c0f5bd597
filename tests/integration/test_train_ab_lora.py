"""A LoRA adapter trained by the async actor-learner on 2 gloo ranks with `vllm.sync.mode: adapter`: the
example config runs, resumes, and the server (which merged the synced adapter onto its own base) answers
the greedy ids of a server started on the last checkpoint's merged `model/`. One run for this topology."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from stagectl.rollout.launcher import start_server_process
from tests.integration.helpers import ROOT, base_state, greedy_ids, read_metrics, run_cli

EXAMPLE = "examples/tiny/train_ab_lora.yaml"


def test_example_lora_config_syncs_the_adapter_resumes_and_serves_the_merged_model(tmp_path: Path) -> None:
    server = start_server_process(
        [
            "--model",
            "builtin:tiny-qwen2.5-vl",
            "--port",
            "0",
            # the server merges synced adapters of this shape onto its base (as the embedded server does)
            "--set",
            "model.adapter={type: lora, r: 8, alpha: 16}",
            "--set",
            "custom.extra.rollout_matching.vllm.sync.mode=adapter",
            "--set",
            f"rollout_server.image_roots=[{Path.home()}]",
        ],
        cwd=ROOT,
        env={"OMP_NUM_THREADS": "1"},
    )
    out = tmp_path / "run"
    common = [
        "--set",
        f"training.output_dir={out}",
        "--set",
        "rollout_server.embedded=false",
        "--set",
        f"custom.extra.rollout_matching.vllm.server.servers=[{{base_url: '{server.url}'}}]",
    ]
    try:
        first = run_cli("train-ab", EXAMPLE, *common, timeout=500)
        assert first.returncode == 0, first.stderr[-4000:]
        resumed = run_cli(
            "train-ab",
            EXAMPLE,
            *common,
            "--set",
            "training.max_steps=10",
            "--set",
            "training.resume_from_checkpoint=latest",
            timeout=500,
        )
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        served = greedy_ids(server.url)
    finally:
        server.stop()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(10))
    assert any(r["kind"] == "B" for r in rows)
    synced = [r for r in rows if "weight_sync/bytes" in r]
    # only the adapter travels: r=8 on 7 linears x 2 layers, float32 (~180 KB; the full model is ~10 MB)
    assert synced and all(r["weight_sync/state_bytes"] < 400_000 for r in synced)

    final = out / "checkpoint-10"
    saved = AutoModelForImageTextToText.from_pretrained(str(final / "model")).state_dict()
    adapter = load_file(str(final / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    base = base_state()
    assert set(saved) == set(base)  # plain names: no base_layer / lora_ tensors in model/
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(saved[q], base[q]), "the adapter was not merged into model/"
    for name in ("lm_head.weight", "model.visual.blocks.0.mlp.gate_proj.weight"):
        assert torch.equal(saved[name], base[name]), f"frozen base weight {name} moved"

    reference = start_server_process(
        ["--model", str(final / "model"), "--port", "0"], cwd=ROOT, env={"OMP_NUM_THREADS": "1"}
    )
    try:
        assert greedy_ids(reference.url) == served
    finally:
        reference.stop()
