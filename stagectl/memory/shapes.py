"""Model shapes for the memory model: parameter counts per part (vision tower, aligner, language model)
and the dimensions the activation formula needs, from a Qwen-VL `config.json` alone (no weights, no
torch, no transformers).

Parts follow ms-swift's freezing names: `vision` = the vision tower (`freeze_vit`), `aligner` = the
merger / projector (`freeze_aligner`; Qwen3-VL's deepstack mergers included), `llm` = the language model
with its embeddings and output head (`freeze_llm`).

The counts come from the architecture formula (`shape_from_hf_config`); for a local checkpoint
`counts_from_safetensors` reads the exact counts from the safetensors headers (a few KB per shard, the
tensors themselves are never read), which also sees embeddings grown by added tokens.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
SAFETENSORS_HEADER_LIMIT = 100 * 1024 * 1024  # a header larger than this is not a safetensors file


@dataclass(frozen=True)
class PartCounts:
    """Parameter counts per freezable part."""

    vision: int
    aligner: int
    llm: int

    @property
    def total(self) -> int:
        return self.vision + self.aligner + self.llm


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know about one model."""

    model_type: str
    counts: PartCounts
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    vision_hidden_size: int
    vision_depth: int
    vision_intermediate_size: int
    vision_gated_mlp: bool  # Qwen2.5-VL's vision MLP is SwiGLU (gate, up, down); the others fc1/fc2
    spatial_merge_size: int  # image tokens = vision patches / merge**2
    llm_layer_params: int  # one decoder layer (an FSDP unit)
    vision_block_params: int  # one vision block (an FSDP unit)

    @property
    def root_params(self) -> int:
        """What `fully_shard(model)` keeps after the per-block units: embeddings, output head, final norm,
        patch embedding and the mergers."""
        blocks = self.num_layers * self.llm_layer_params + self.vision_depth * self.vision_block_params
        return self.counts.total - blocks


def shape_from_hf_config(config: dict[str, Any]) -> ModelShape:
    """The shape of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model from its `config.json` contents. Text keys are
    read from `text_config`, or from the top level as older Qwen2.5-VL checkpoints write them."""
    if not isinstance(config, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type not in QWEN_VL_TYPES:
        raise ValueError(
            f"config.json model_type {model_type!r}: the memory model knows {', '.join(QWEN_VL_TYPES)} only"
        )
    text = config.get("text_config") or config
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError(f"config.json ({model_type}) has no vision_config")
    try:
        return _shape(model_type, text, vision, config)
    except KeyError as exc:
        raise ValueError(f"config.json ({model_type}) lacks key {exc.args[0]!r}") from None


def _shape(model_type: str, text: dict[str, Any], vision: dict[str, Any], top: dict[str, Any]) -> ModelShape:
    h, num_layers, inter = text["hidden_size"], text["num_hidden_layers"], text["intermediate_size"]
    num_heads, vocab = text["num_attention_heads"], text["vocab_size"]
    num_kv = text.get("num_key_value_heads", num_heads)
    head_dim = text.get("head_dim") or h // num_heads
    qwen3 = model_type == "qwen3_vl"
    q_dim, kv_dim = num_heads * head_dim, num_kv * head_dim
    qkv_bias = text.get("attention_bias", False) if qwen3 else True  # Qwen2 attention: q/k/v biases
    attn = h * (q_dim + 2 * kv_dim) + (q_dim + 2 * kv_dim) * qkv_bias + q_dim * h
    qk_norm = 2 * head_dim if qwen3 else 0
    layer = attn + qk_norm + 3 * h * inter + 2 * h  # + gate/up/down, two RMSNorms
    tied = bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    llm = vocab * h * (1 if tied else 2) + num_layers * layer + h

    patch, temporal, chans = (
        vision["patch_size"],
        vision.get("temporal_patch_size", 2),
        vision.get("in_channels", 3),
    )
    merge = vision.get("spatial_merge_size", 2)
    if model_type == "qwen2_vl":  # vision `hidden_size` is the merger's output there
        hv, depth = vision["embed_dim"], vision["depth"]
        iv, out_hidden, gated = int(hv * vision.get("mlp_ratio", 4)), vision["hidden_size"], False
    else:
        hv, depth, iv, out_hidden = (
            vision["hidden_size"],
            vision["depth"],
            vision["intermediate_size"],
            vision["out_hidden_size"],
        )
        gated = model_type == "qwen2_5_vl"
    norm = hv if model_type == "qwen2_5_vl" else 2 * hv  # RMSNorm (weight) vs LayerNorm (weight + bias)
    mlp = 3 * hv * iv + 2 * iv + hv if gated else 2 * hv * iv + iv + hv
    block = 2 * norm + (3 * hv * hv + 3 * hv) + (hv * hv + hv) + mlp
    patch_embed = chans * temporal * patch * patch * hv + (hv if qwen3 else 0)
    pos_embed = vision.get("num_position_embeddings", 0) * hv if qwen3 else 0
    vision_params = patch_embed + pos_embed + depth * block
    merged = hv * merge * merge

    def merger(norm_dim: int) -> int:
        norm_params = norm_dim if model_type == "qwen2_5_vl" else 2 * norm_dim
        return norm_params + merged * merged + merged + merged * out_hidden + out_hidden

    aligner = merger(hv)
    if qwen3:  # deepstack mergers normalise after the 2x2 shuffle
        aligner += len(vision.get("deepstack_visual_indexes", [])) * merger(merged)
    return ModelShape(
        model_type=model_type,
        counts=PartCounts(vision=vision_params, aligner=aligner, llm=llm),
        hidden_size=h,
        num_layers=num_layers,
        intermediate_size=inter,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        vocab_size=vocab,
        vision_hidden_size=hv,
        vision_depth=depth,
        vision_intermediate_size=iv,
        vision_gated_mlp=gated,
        spatial_merge_size=merge,
        llm_layer_params=layer,
        vision_block_params=block,
    )


def part_of(tensor_name: str) -> str:
    """`vision`, `aligner` or `llm` for a checkpoint tensor name (old `visual.*` and new `model.visual.*`)."""
    if "visual." not in tensor_name:
        return "llm"
    return "aligner" if ".merger" in tensor_name or "deepstack_merger" in tensor_name else "vision"


def counts_from_safetensors(checkpoint: Path) -> PartCounts | None:
    """Exact per-part counts from the headers of `checkpoint/*.safetensors`; None when there are none."""
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        return None
    sums = {"vision": 0, "aligner": 0, "llm": 0}
    for path in files:
        for name, info in _safetensors_header(path).items():
            if name == "__metadata__":
                continue
            numel = 1
            for dim in info["shape"]:
                numel *= int(dim)
            sums[part_of(name)] += numel
    return PartCounts(**sums)


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > SAFETENSORS_HEADER_LIMIT:
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    return header


def shape_from_checkpoint(checkpoint: Path) -> ModelShape:
    """The shape from `checkpoint/config.json`, with exact counts from its safetensors headers when present."""
    config_path = checkpoint / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{checkpoint}: no config.json")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:  # a ValueError that names no file
        raise ValueError(f"{config_path}: not valid JSON ({exc})") from None
    shape = shape_from_hf_config(config)
    counts = counts_from_safetensors(checkpoint)
    return shape if counts is None else replace(shape, counts=counts)
