"""What a full sync must send to the vllm engine, read from the checkpoint alone (no vLLM needed): every
safetensors tensor in the engine dtype, plus `lm_head.weight` for tied embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stagectl.engines.interface import TensorSpec
from stagectl.engines.vllm import checkpoint_specs


def _checkpoint(path: Path, *, tied: bool) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "tie_word_embeddings": tied}))
    save_file(
        {"model.embed_tokens.weight": torch.zeros(8, 4), "model.norm.weight": torch.ones(4)},
        path / "a.safetensors",
    )
    save_file(
        {"model.layers.0.mlp.up_proj.weight": torch.zeros(6, 4, dtype=torch.bfloat16)}, path / "b.safetensors"
    )
    return path


def test_specs_cover_every_shard_in_the_engine_dtype(tmp_path: Path) -> None:
    specs = checkpoint_specs(_checkpoint(tmp_path / "untied", tied=False), "float32")
    assert specs == {
        "model.embed_tokens.weight": TensorSpec((8, 4), "float32"),
        "model.norm.weight": TensorSpec((4,), "float32"),
        "model.layers.0.mlp.up_proj.weight": TensorSpec((6, 4), "float32"),
    }


def test_tied_embeddings_also_need_the_head(tmp_path: Path) -> None:
    specs = checkpoint_specs(_checkpoint(tmp_path / "tied", tied=True), "bfloat16")
    assert specs["lm_head.weight"] == specs["model.embed_tokens.weight"] == TensorSpec((8, 4), "bfloat16")


def test_a_checkpoint_without_safetensors_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="needs a safetensors checkpoint"):
        checkpoint_specs(tmp_path, "float32")
