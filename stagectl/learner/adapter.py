"""`model.adapter`: LoRA / DoRA through peft, injected in place into the learner's model.

peft's `inject_adapter_in_model` keeps the model's class and module tree: each targeted linear layer
becomes a peft `LoraLayer` holding the frozen base (`<name>.base_layer.weight`) and the adapter
(`<name>.lora_A.default.weight` (r, in), `<name>.lora_B.default.weight` (out, r), and for DoRA
`<name>.lora_magnitude_vector.default.weight` (out,)). Everything that leaves the learner as a plain
model (checkpoint `model/`, full weight syncs, `stagectl export`) goes through `merged_state_dict`, which
gives the original parameter names and the merged weights; `adapter/` holds peft's own format, which
`PeftModel.from_pretrained` loads.

The merge (`stagectl.models.lora.merge_weight`) is peft's, written out so the rollout server applies a
synced adapter without peft and bit-identically to `merged_state_dict`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stagectl.config.model_data import AdapterConfig
from stagectl.learner.parts import FreezeReport
from stagectl.models.lora import merge_weight, target_regex

ADAPTER_DIR = "adapter"  # in a checkpoint: peft's save_pretrained layout
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # how a PeftModel's saved adapter names its tensors
ADAPTER_NAME = "default"


def peft_config(cfg: AdapterConfig) -> Any:
    import peft

    return peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=target_regex(cfg.target_modules),
        use_dora=cfg.type == "dora",
        bias="none",
    )


def apply_adapter(model: nn.Module, cfg: AdapterConfig) -> FreezeReport:
    """Freeze the whole base model, then inject the adapter (trainable, float32 like the masters)."""
    import peft

    for param in model.parameters():
        param.requires_grad_(False)
    peft.inject_adapter_in_model(peft_config(cfg), model)
    layers = lora_layers(model)
    if not layers:
        raise ValueError(
            f"model.adapter.target_modules {cfg.target_modules}: no such linear layer in the language model "
            f"of {type(model).__name__}"
        )
    for layer in layers.values():
        for param in _adapter_params(layer):
            param.requires_grad_(True)
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    num_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return FreezeReport(num_trainable=num_trainable, num_frozen=num_frozen, frozen_parts=("base",))


def has_adapter(model: nn.Module) -> bool:
    return bool(lora_layers(model))


def lora_layers(model: nn.Module) -> dict[str, Any]:
    """`{module name: peft LoraLayer}` in module order (empty without an adapter)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def _adapter_params(layer: Any) -> list[nn.Parameter]:
    params = [layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight]
    if ADAPTER_NAME in layer.lora_magnitude_vector:
        params.append(layer.lora_magnitude_vector[ADAPTER_NAME].weight)
    return params


def merged_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The plain model's state dict (original names, adapter merged in), CPU tensors in `dtype` (None:
    the parameters' dtype). Without an adapter: the model's own state dict."""
    layers = lora_layers(model)
    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, layer in layers.items():
            magnitude = None
            if ADAPTER_NAME in layer.lora_magnitude_vector:
                magnitude = layer.lora_magnitude_vector[ADAPTER_NAME].weight
            merged[f"{name}.weight"] = merge_weight(
                layer.base_layer.weight,
                layer.lora_A[ADAPTER_NAME].weight,
                layer.lora_B[ADAPTER_NAME].weight,
                float(layer.scaling[ADAPTER_NAME]),
                magnitude,
            )
        out: dict[str, torch.Tensor] = {}
        for key, tensor in model.state_dict().items():
            if ".lora_" in key:
                continue
            plain = key.replace(".base_layer.", ".")
            value = merged.get(plain, tensor).detach()
            out[plain] = value.to("cpu", dtype=dtype or tensor.dtype)
    return out


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors as peft names them in a saved adapter (`...q_proj.lora_A.weight`), float32 CPU."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)
    return {k: v.detach().to("cpu", dtype=torch.float32).contiguous() for k, v in state.items()}


def save_adapter(model: nn.Module, cfg: AdapterConfig, base_name_or_path: str, path: Path) -> None:
    """`path/` in peft's `save_pretrained` layout (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = peft_config(cfg)
    config.base_model_name_or_path = base_name_or_path
    config.save_pretrained(str(path))
    state = {PEFT_PREFIX + k: v for k, v in adapter_state_dict(model).items()}
    save_file(state, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def load_adapter(model: nn.Module, path: Path) -> None:
    """Overwrite the injected adapter's weights with those saved in `path/` (strict: every tensor)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(path / ADAPTER_WEIGHTS))
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in saved.items()}
    expected = set(adapter_state_dict(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(
            f"{path / ADAPTER_WEIGHTS} does not match model.adapter (missing {missing[:3]}, unexpected "
            f"{extra[:3]}); resume with the adapter settings the checkpoint was trained with"
        )
    set_peft_model_state_dict(model, state, adapter_name=ADAPTER_NAME)


def saved_adapter_settings(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / ADAPTER_CONFIG).read_text()))
