"""The memory model's inputs from a resolved config's parts: the training knobs (`model`, `training` and
`global_max_length`) and the model shape of `model.name_or_path` (its `config.json` and safetensors
headers; never the weights, never torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from stagectl.cache import cache_root
from stagectl.config.model_data import ModelConfig
from stagectl.config.training import TrainingConfig
from stagectl.memory.estimate import AdapterKnobs, TrainingKnobs
from stagectl.memory.shapes import ModelShape, shape_from_checkpoint

BUILTIN_PREFIX = "builtin:"  # = stagectl.models.tiny.BUILTIN_PREFIX (that module imports torch)


def knobs_from_config(
    model: ModelConfig, training: TrainingConfig, *, global_max_length: int, world_size: int
) -> TrainingKnobs:
    """Every config key the estimate depends on."""
    adapter = None
    if model.adapter is not None:
        a = model.adapter
        adapter = AdapterKnobs(type=a.type, r=a.r, target_modules=tuple(a.target_modules))
    return TrainingKnobs(
        world_size=world_size,
        parallelism=training.parallelism,
        mixed_precision=training.mixed_precision,
        allow_low_precision_params=training.allow_low_precision_params,
        gradient_checkpointing=training.gradient_checkpointing,
        freeze_vit=model.freeze_vit,
        freeze_aligner=model.freeze_aligner,
        freeze_llm=model.freeze_llm,
        adapter=adapter,
        torch_dtype=model.torch_dtype,
        global_max_length=global_max_length,
        per_device_train_batch_size=training.per_device_train_batch_size,
        attention=_attention(model.attn_implementation),
    )


def _attention(attn_implementation: str | None) -> Literal["flash_attention_2", "sdpa", "eager"]:
    if attn_implementation == "flash_attention_2":
        return "flash_attention_2"
    if attn_implementation == "eager":
        return "eager"
    return "sdpa"  # what transformers chooses when the key is null


def checkpoint_dir(name_or_path: str) -> Path:
    """The directory holding `config.json` for a local checkpoint or a built-in tiny model's cache entry;
    `ValueError` when there is none (a built-in model is built by its first use, e.g. `stagectl tiny-model`)."""
    if name_or_path.startswith(BUILTIN_PREFIX):
        arch = name_or_path.removeprefix(BUILTIN_PREFIX).removeprefix("tiny-")
        path = cache_root() / "models" / f"tiny-{arch}"  # = stagectl.models.tiny.cache_root()
        if not (path / "config.json").is_file():
            raise ValueError(f"{name_or_path} is not built yet ({path}); it is built on first use")
        return path
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json")
    return path


def model_shape(name_or_path: str) -> ModelShape:
    """The shape of `model.name_or_path`; `ValueError` naming the problem."""
    return shape_from_checkpoint(checkpoint_dir(name_or_path))
