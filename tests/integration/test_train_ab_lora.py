"""A LoRA adapter trained by the async actor-learner on 2 gloo ranks with `vllm.sync.mode: adapter`: the
example config runs, resumes, and the server (which merged the synced adapter onto its own base) answers
the greedy ids of a server started on the last checkpoint's merged `model/`. One run for this topology."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from tests.integration.helpers import (
    base_state,
    external_server_overrides,
    greedy_ids,
    in_process_server,
    read_metrics,
    run_cli,
    tiny_train_config,
    write_config,
)

EXAMPLE = "examples/tiny/train_ab_lora.yaml"


def test_example_lora_config_syncs_the_adapter_resumes_and_serves_the_merged_model(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # the external server in this process (the same app as `stagectl rollout-server`, one process fewer);
    # it merges synced adapters of this shape onto its base (as the embedded server does)
    sets = [
        "model.adapter={type: lora, r: 8, alpha: 16}",
        "custom.extra.rollout_matching.vllm.sync.mode=adapter",
        f"rollout_server.image_roots=[{Path.home()}]",
    ]
    with in_process_server("builtin:tiny-qwen2.5-vl", *sets) as url:
        common = external_server_overrides(out, url)
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
        served = greedy_ids(url)
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

    # adapter/ is peft's format: peft's own merge of it onto the base is exactly model/
    from peft import PeftModel

    from stagectl.models.loading import load_bundle

    base_model = load_bundle("builtin:tiny-qwen2.5-vl", add_coord_tokens=True).model
    by_peft = PeftModel.from_pretrained(base_model, str(final / "adapter")).merge_and_unload().state_dict()
    assert set(by_peft) == set(saved) and all(torch.equal(by_peft[k], saved[k]) for k in saved)
    # `stagectl export` of the run is a plain model directory holding the merged weights
    from stagectl.models.export import export_model

    export_model(str(out), tmp_path / "exported")
    exported = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "exported")).state_dict()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)

    with in_process_server(str(final / "model")) as reference:  # in this process: no second server start-up
        assert greedy_ids(reference) == served


def test_adapter_resume_is_exact_under_ddp(tmp_path: Path) -> None:
    """2 DDP ranks, Channel-A only: a run resumed from checkpoint-2 trains steps 2-3 with the same losses
    and ends with the same adapter (the base comes from model.name_or_path, the adapter from adapter/)."""

    def config(name: str, **training: object) -> dict:
        return tiny_train_config(
            tmp_path,
            model={"adapter": {"type": "lora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
            training={
                "gradient_accumulation_steps": 2,
                "max_steps": 4,
                "save_steps": 2,
                "learning_rate": 1e-2,
                "output_dir": str(tmp_path / name),
                **training,
            },
            launch={"nproc_per_node": 2, "watchdog": {"step_s": 120}},
            stage2_ab={"schedule": {"b_ratio": 0.0}, "channel_b": {"mode": "step"}},
        )

    first = run_cli("train-ab", str(write_config(tmp_path / "first.yaml", config("first"))), timeout=400)
    assert first.returncode == 0, first.stderr[-4000:]
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "first" / "checkpoint-2", resumed_dir / "checkpoint-2")
    cfg = config("resumed", resume_from_checkpoint="latest")
    again = run_cli("train-ab", str(write_config(tmp_path / "resumed.yaml", cfg)), timeout=400)
    assert again.returncode == 0, again.stderr[-4000:]
    original = {r["step"]: r for r in read_metrics(tmp_path / "first")}
    resumed = {r["step"]: r for r in read_metrics(resumed_dir)}
    assert original[3]["loss"] != original[0]["loss"]  # the adapter trains
    for step in (2, 3):
        assert resumed[step]["loss"] == original[step]["loss"], step
    a = load_file(str(tmp_path / "first" / "checkpoint-4" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(resumed_dir / "checkpoint-4" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
