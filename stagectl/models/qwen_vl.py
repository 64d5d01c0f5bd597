"""Everything stagectl knows about one vision-language family in particular: Qwen-VL (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL). Every other model is handled through the transformers Auto classes alone.

Two rules are family-specific and live only here:
- image-token expansion: the chat template writes one `<|image_pad|>` per image; the prompt carries
  one per merged vision patch (`prod(grid_thw) // merge_size**2`), in image order;
- multimodal rotary positions for packing: the (t, h, w) position rows come from the model's own
  `model.model.get_rope_index`, computed per segment.

A vision-language checkpoint of another family (Gemma 3, LLaVA, ...) still loads, serves and judges
text; asking it for either rule (images in a prompt, packing) fails with `unsupported_vlm`'s error,
which names the family and what stagectl would need for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from stagectl.models.capability import QWEN_VL_MODEL_TYPES
from stagectl.models.images import ImageInputs, preprocess_images
from stagectl.models.tokenizer import IMAGE_PAD, token_id


def is_vision_language(config: PretrainedConfig) -> bool:
    """Whether a model config describes a vision-language model (it has a vision tower config)."""
    return "vision_config" in type(config).sub_configs


def is_qwen_vl(config: PretrainedConfig) -> bool:
    return config.model_type in QWEN_VL_MODEL_TYPES


def unsupported_vlm(family: str, what: str) -> ValueError:
    """The error for a vision-language family stagectl has no rules for (`family`: e.g. "model_type 'gemma3'")."""
    return ValueError(
        f"{what} is not supported for the vision-language {family}: stagectl knows the image-token "
        f"expansion and the multimodal rotary positions (get_rope_index) of {', '.join(QWEN_VL_MODEL_TYPES)} "
        "only, and has neither rule for this family; text-only requests to this model work"
    )


def require_image_processor(image_processor: Any, model_type: str | None = None) -> Qwen2VLImageProcessorPil:
    """`image_processor` as the Qwen-VL patch processor; `ValueError` for any other family's."""
    if not isinstance(image_processor, Qwen2VLImageProcessorPil):
        family = (
            f"model_type {model_type!r}"
            if model_type
            else f"model with image processor {type(image_processor).__name__}"
        )
        raise unsupported_vlm(family, "images")
    return image_processor


def expand_image_pads(
    tokenizer: PreTrainedTokenizerBase, template_ids: Sequence[int], num_image_tokens: Sequence[int]
) -> list[int]:
    """Each `<|image_pad|>` of `template_ids` repeated to its image's merged-token count, in image order."""
    image_pad_id = token_id(tokenizer, IMAGE_PAD)
    num_placeholders = list(template_ids).count(image_pad_id)
    if num_placeholders != len(num_image_tokens):
        raise ValueError(
            f"the chat template produced {num_placeholders} image placeholders for {len(num_image_tokens)} images"
        )
    ids: list[int] = []
    counts = iter(num_image_tokens)
    for template_id in template_ids:
        ids.extend([image_pad_id] * next(counts) if template_id == image_pad_id else [template_id])
    return ids


def encode_images(
    tokenizer: PreTrainedTokenizerBase,
    image_processor: Qwen2VLImageProcessorPil,
    template_ids: Sequence[int],
    images: Sequence[Image.Image],
) -> tuple[list[int], list[int], ImageInputs]:
    """Template ids with images -> (expanded ids, mm_token_type_ids (1 on image tokens), image tensors)."""
    inputs = preprocess_images(list(images), image_processor)
    ids = expand_image_pads(tokenizer, template_ids, inputs.num_image_tokens)
    image_pad_id = token_id(tokenizer, IMAGE_PAD)
    return ids, [int(i == image_pad_id) for i in ids], inputs


def rope_position_ids(
    model: Any,
    input_ids: Sequence[int],
    mm_token_type_ids: Sequence[int],
    image_grid_thw: torch.Tensor | None,
) -> torch.Tensor:
    """(3, T) multimodal (t, h, w) rotary positions of one sequence alone, from the model's `get_rope_index`."""
    config = model.config
    if not is_qwen_vl(config):
        raise unsupported_vlm(f"model_type {config.model_type!r}", "packing")
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    mm_types = torch.tensor([list(mm_token_type_ids)], dtype=torch.int)
    positions, _ = model.model.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=image_grid_thw)
    return positions[:, 0]  # (3, 1, T) -> (3, T)
