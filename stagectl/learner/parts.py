"""The parts of a vision-language model the learner treats differently: what `model.freeze_*` freezes,
and the transformer blocks that FSDP2 shards one by one and activation checkpointing recomputes.

The parts follow ms-swift's model architecture table for the Qwen-VL family (the same meaning as its
`freeze_vit` / `freeze_aligner` / `freeze_llm`):
- vision tower (`vit`): `model.visual`, less the aligner;
- aligner: the patch merger that projects vision features into the language model (`model.visual.merger`,
  plus Qwen3-VL's `deepstack_merger_list`);
- language model (`llm`): `model.language_model` and `lm_head` (embeddings included).

Transformer blocks are the modules whose class the checkpoint names in `_no_split_modules` (the decoder
layers and the vision blocks): the unit transformers and accelerate already use for sharding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

VISION_LANGUAGE_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class FreezeReport:
    """What freezing left trainable: counts of parameters (elements) per state."""

    num_trainable: int
    num_frozen: int
    frozen_parts: tuple[str, ...]


def model_parts(model: nn.Module) -> dict[str, list[nn.Module]]:
    """`{"vit": [...], "aligner": [...], "llm": [...]}` for a Qwen-VL model (`ValueError` otherwise)."""
    model_type = getattr(model.config, "model_type", "")
    if model_type not in VISION_LANGUAGE_TYPES:
        raise ValueError(
            f"model.freeze_*: parts are known for {', '.join(VISION_LANGUAGE_TYPES)} models, not "
            f"{model_type!r}; unset model.freeze_vit / freeze_aligner / freeze_llm for this model"
        )
    inner: Any = model.model  # every Qwen-VL *ForConditionalGeneration has it
    visual = inner.visual
    aligner: list[nn.Module] = [visual.merger]
    if hasattr(visual, "deepstack_merger_list"):  # Qwen3-VL
        aligner.append(visual.deepstack_merger_list)
    lm_head: Any = model.lm_head
    return {"vit": [visual], "aligner": aligner, "llm": [inner.language_model, lm_head]}


def freeze_parts(model: nn.Module, *, vit: bool, aligner: bool, llm: bool) -> FreezeReport:
    """Set `requires_grad=False` on the chosen parts (the aligner stays trainable under `vit` unless it
    is frozen too, as in ms-swift). Frozen parameters then get no gradient and no optimizer state."""
    chosen = {"vit": vit, "aligner": aligner, "llm": llm}
    frozen_parts = tuple(name for name, on in chosen.items() if on)
    if frozen_parts:
        parts = model_parts(model)
        keep = {id(p) for m in parts["aligner"] for p in m.parameters()} if not aligner else set()
        for name in frozen_parts:
            for module in parts[name]:
                for param in module.parameters():
                    if id(param) not in keep:
                        param.requires_grad_(False)
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    num_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    if num_trainable == 0:
        raise ValueError(
            f"model.freeze_*: freezing {', '.join(frozen_parts)} leaves no trainable parameter; "
            "unfreeze a part or add model.adapter"
        )
    return FreezeReport(num_trainable=num_trainable, num_frozen=num_frozen, frozen_parts=frozen_parts)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """Every module whose class is in the model's `_no_split_modules` (decoder layers, vision blocks),
    in module order; `ValueError` when the model names none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no transformer block class (_no_split_modules); "
            "training.parallelism: fsdp and training.gradient_checkpointing need one"
        )
    return blocks


def trainable_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
