"""`model.adapter`: peft LoRA / DoRA injected into the tiny Qwen2.5-VL; the merge, the saved adapter, and
the config rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stagectl.config import load_config
from stagectl.config.loader import ConfigError
from stagectl.config.model_data import AdapterConfig
from stagectl.learner import adapter
from stagectl.models.loading import load_bundle

TINY = "builtin:tiny-qwen2.5-vl"


def _adapted(kind: str = "lora", **kw: object) -> torch.nn.Module:
    model = load_bundle(TINY).model
    adapter.apply_adapter(model, AdapterConfig(type=kind, r=4, alpha=8, **kw))  # type: ignore[arg-type]
    torch.manual_seed(1)
    with torch.no_grad():  # B starts at zero (merged == base); give the adapter something to merge
        for layer in adapter.lora_layers(model).values():
            layer.lora_B["default"].weight.normal_(0, 0.5)
            if "default" in layer.lora_magnitude_vector:
                layer.lora_magnitude_vector["default"].weight.mul_(1.5)
    return model


def test_lora_trains_only_the_adapter_on_the_language_models_linears() -> None:
    model = load_bundle(TINY).model
    report = adapter.apply_adapter(model, AdapterConfig())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not any("visual" in n for n in trainable)  # the tower's MLP has gate/up/down_proj too
    suffixes = {n.split(".lora_")[0].rsplit(".", 1)[1] for n in trainable}
    assert suffixes == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert report.num_trainable == sum(p.numel() for n, p in model.named_parameters() if n in trainable)
    dora = load_bundle(TINY).model
    adapter.apply_adapter(dora, AdapterConfig(type="dora", target_modules=["q_proj"]))
    assert any(
        n.endswith("lora_magnitude_vector.default.weight")
        for n, p in dora.named_parameters()
        if p.requires_grad
    )


def test_lora_merge_is_base_plus_scaled_delta_with_the_plain_names() -> None:
    base_state = load_bundle(TINY).model.state_dict()
    model = _adapted(target_modules=["q_proj", "down_proj"])
    merged = adapter.merged_state_dict(model)
    assert set(merged) == set(base_state)
    layers = adapter.lora_layers(model)
    for name, layer in layers.items():
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        expected = base_state[f"{name}.weight"] + (8.0 / 4) * (b @ a)
        torch.testing.assert_close(merged[f"{name}.weight"], expected)
        assert not torch.equal(merged[f"{name}.weight"], base_state[f"{name}.weight"])
    untouched = [k for k in base_state if not any(k.startswith(n + ".") for n in layers)]
    assert untouched and all(torch.equal(merged[k], base_state[k]) for k in untouched)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_merged_model_gives_the_adapted_models_logits(kind: str) -> None:
    model = _adapted(kind).eval()
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    plain = load_bundle(TINY).model.eval()
    plain.load_state_dict(adapter.merged_state_dict(model), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, adapted, atol=1e-4, rtol=1e-4)


def test_dora_merge_equals_peft_own_merge() -> None:
    model = _adapted("dora", target_modules=["v_proj"])
    ours = adapter.merged_state_dict(model)
    for name, layer in adapter.lora_layers(model).items():
        layer.merge()  # peft writes the merged weight into base_layer in place
        torch.testing.assert_close(
            ours[f"{name}.weight"], layer.base_layer.weight.detach(), atol=1e-5, rtol=1e-5
        )


def test_saved_adapter_loads_back_exactly_and_a_mismatch_is_refused(tmp_path: Path) -> None:
    model = _adapted(target_modules=["q_proj"])
    adapter.save_adapter(model, AdapterConfig(r=4, alpha=8, target_modules=["q_proj"]), TINY, tmp_path / "a")
    assert adapter.saved_adapter_settings(tmp_path / "a")["r"] == 4
    fresh = load_bundle(TINY).model
    adapter.apply_adapter(fresh, AdapterConfig(r=4, alpha=8, target_modules=["q_proj"]))
    adapter.load_adapter(fresh, tmp_path / "a")
    saved, loaded = adapter.adapter_state_dict(model), adapter.adapter_state_dict(fresh)
    assert set(saved) == set(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
    other = load_bundle(TINY).model
    adapter.apply_adapter(other, AdapterConfig(r=4, alpha=8, target_modules=["v_proj"]))
    with pytest.raises(ValueError, match=r"does not match model\.adapter"):
        adapter.load_adapter(other, tmp_path / "a")


ADAPTER = "model.adapter={type: lora, r: 4}"
TRAIN = ["data.synthetic={num_samples: 8}", "stage2_ab.schedule.b_ratio=0.0", ADAPTER]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.adapter={target_modules: [qkv]}"], r"target_modules \['qkv'\]: choose"),
        (["model.adapter={target_modules: []}"], r"target_modules \[\]"),
        ([ADAPTER, "model.freeze_llm=true"], "adapter lives in the language model"),
        ([*TRAIN, "training.parallelism=fsdp"], "fsdp with model.adapter is not supported"),
        (
            [*TRAIN, "model.torch_dtype=bfloat16", "training.allow_low_precision_params=true"],
            "training.allow_low_precision_params: with model.adapter",
        ),
    ],
)
def test_adapter_config_rules(overrides: list[str], message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        load_config(None, overrides, world_size=2)


def test_adapter_config_defaults_and_freeze_vit_combine() -> None:
    cfg = load_config(None, [*TRAIN, "model.freeze_vit=true"], world_size=2)
    assert cfg.model.adapter is not None and cfg.model.adapter.target_modules[0] == "q_proj"
    assert adapter.target_regex(cfg.model.adapter.target_modules).startswith(r".*language_model\.")


@pytest.mark.parametrize(("kind", "dtype"), [("lora", "float32"), ("dora", "bfloat16")])
def test_hf_server_merges_a_synced_adapter_bit_identically_to_the_checkpoint(kind: str, dtype: str) -> None:
    """`sync.mode: adapter`: the hf engine's specs are the adapter's (peft names, float32), and after
    `apply_weights` it serves exactly the weights `merged_state_dict` writes to a checkpoint's model/."""
    from stagectl.config.plan_server import server_plan
    from stagectl.server.serving import build_engine
    from stagectl.weightsync.wire import spec_of

    learner = _adapted(kind)
    overrides = [
        f"model.adapter={{type: {kind}, r: 4, alpha: 8}}",
        "custom.extra.rollout_matching.vllm.sync.mode=adapter",
        f"model.torch_dtype={dtype}",
    ]
    engine = build_engine(server_plan(load_config(None, overrides)))
    try:
        sent = adapter.adapter_state_dict(learner)
        assert {k: spec_of(v) for k, v in sent.items()} == engine.weight_specs()
        engine.apply_weights(sent, 3)
        served = engine.model.state_dict()  # type: ignore[attr-defined]
        expected = adapter.merged_state_dict(learner, dtype=getattr(torch, dtype))
        assert set(served) == set(expected) and engine.version == 3
        different = [k for k in expected if not torch.equal(served[k], expected[k])]
        assert not different, different[:3]
    finally:
        engine.close()
