"""The published shapes of the real checkpoints the docs table covers: the keys of their `config.json`
(Hugging Face `Qwen/...-Instruct`) that the memory model reads. Nothing is downloaded; the parameter
totals these give are checked in `tests/unit/memory/test_memory.py` against the models transformers builds
from the same dicts on the meta device (8,292,166,656 for Qwen2.5-VL-7B, the published count)."""

from __future__ import annotations

from typing import Any

_QWEN25_VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "hidden_act": "silu",
}

REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen2.5-VL-3B": {
        "model_type": "qwen2_5_vl",
        "tie_word_embeddings": True,
        "text_config": {
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
        },
        "vision_config": {**_QWEN25_VISION, "out_hidden_size": 2048},
    },
    "Qwen2.5-VL-7B": {
        "model_type": "qwen2_5_vl",
        "tie_word_embeddings": False,
        "text_config": {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
        },
        "vision_config": {**_QWEN25_VISION, "out_hidden_size": 3584},
    },
    "Qwen3-VL-8B": {
        "model_type": "qwen3_vl",
        "tie_word_embeddings": False,
        "text_config": {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "attention_bias": False,
            "vocab_size": 151936,
        },
        "vision_config": {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 2304,
            "out_hidden_size": 4096,
            "deepstack_visual_indexes": [8, 16, 24],
            "hidden_act": "gelu_pytorch_tanh",
        },
    },
}
