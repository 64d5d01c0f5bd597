"""The LoRA / DoRA merge, shared by the learner (checkpoints, full syncs of the merged model) and the
rollout server's hf engine (applying a synced adapter on top of its base), so both compute bit-identical
merged weights. Pure torch; no peft.

Names follow peft's saved adapters: for a targeted linear layer `<layer>` (weight (out, in)) the adapter
is `<layer>.lora_A.weight` (r, in), `<layer>.lora_B.weight` (out, r) and, for DoRA,
`<layer>.lora_magnitude_vector` (out,). The scaling is alpha / r.
"""

from __future__ import annotations

import re

import torch
from torch import nn

LORA_A, LORA_B, MAGNITUDE = ".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector"


def target_regex(target_modules: list[str] | tuple[str, ...]) -> str:
    """peft `target_modules` as a full-match regex: the chosen linear layers of the language model only
    (the Qwen-VL vision blocks also have `gate_proj`/`up_proj`/`down_proj`)."""
    return rf".*language_model\..*\.({'|'.join(target_modules)})"


def target_layers(model: nn.Module, target_modules: list[str] | tuple[str, ...]) -> dict[str, nn.Linear]:
    """`{name: linear}` of the layers an adapter with `target_modules` covers, in module order."""
    pattern = re.compile(target_regex(target_modules))
    return {
        name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and pattern.fullmatch(name)
    }


def adapter_shapes(out_features: int, in_features: int, r: int, dora: bool) -> dict[str, tuple[int, ...]]:
    """The adapter tensors of one layer: name suffix -> shape."""
    shapes: dict[str, tuple[int, ...]] = {LORA_A: (r, in_features), LORA_B: (out_features, r)}
    if dora:
        shapes[MAGNITUDE] = (out_features,)
    return shapes


def merge_weight(
    base: torch.Tensor,  # (out, in)
    lora_a: torch.Tensor,  # (r, in)
    lora_b: torch.Tensor,  # (out, r)
    scaling: float,
    magnitude: torch.Tensor | None = None,  # (out,) DoRA only
) -> torch.Tensor:
    """The merged weight (out, in) in float32: LoRA W + s·B·A; DoRA m / ‖W + s·B·A‖_row · (W + s·B·A)
    (peft's merge, written out)."""
    weight = base.float() + scaling * (lora_b.float() @ lora_a.float())
    if magnitude is None:
        return weight
    norm = torch.linalg.norm(weight, dim=1)  # (out,)
    return (magnitude.float() / norm).unsqueeze(1) * weight
