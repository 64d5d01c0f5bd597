"""What stays Qwen-VL-specific is asked of no other family: text models pack with plain restarting
positions, and a vision-language family stagectl has no rules for fails saying what is missing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Gemma3Config, LlamaConfig, Qwen2_5_VLConfig
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from stagectl.collate import Segment, collate_pack, segment_position_ids
from stagectl.models import qwen_vl
from stagectl.models.images import build_image_processor


def _segment(n: int, with_image: bool = False) -> Segment:
    pixels = torch.zeros(4, 8) if with_image else None
    grid = torch.tensor([[1, 2, 2]]) if with_image else None
    return Segment(list(range(10, 10 + n)), [0.0] + [1.0] * (n - 1), [0] * n, pixels, grid)


def test_vision_language_is_read_from_the_config() -> None:
    assert qwen_vl.is_vision_language(Qwen2_5_VLConfig()) and qwen_vl.is_qwen_vl(Qwen2_5_VLConfig())
    assert qwen_vl.is_vision_language(Gemma3Config()) and not qwen_vl.is_qwen_vl(Gemma3Config())
    assert not qwen_vl.is_vision_language(LlamaConfig())


def test_text_models_pack_with_restarting_positions() -> None:
    model = SimpleNamespace(config=LlamaConfig())
    assert segment_position_ids(_segment(5), model).tolist() == [[0, 1, 2, 3, 4]]  # type: ignore[arg-type]
    batch = collate_pack([_segment(3), _segment(2)], model)  # type: ignore[arg-type]
    assert batch.position_ids is not None and batch.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    inputs = batch.model_inputs()
    assert "mm_token_type_ids" not in inputs and inputs["use_cache"] is False
    with pytest.raises(ValueError, match="segment has images but 'llama' is a text-only model"):
        segment_position_ids(_segment(4, with_image=True), model)  # type: ignore[arg-type]


def test_an_unknown_vision_language_family_names_what_is_missing() -> None:
    model = SimpleNamespace(config=Gemma3Config())
    with pytest.raises(ValueError) as raised:
        segment_position_ids(_segment(4), model)  # type: ignore[arg-type]
    message = str(raised.value)
    assert "packing is not supported for the vision-language model_type 'gemma3'" in message
    assert "get_rope_index" in message and "image-token expansion" in message
    assert "qwen2_vl, qwen2_5_vl, qwen3_vl" in message


def test_images_need_the_qwen_vl_patch_processor() -> None:
    qwen = build_image_processor(14)
    assert qwen_vl.require_image_processor(qwen, "qwen2_5_vl") is qwen
    with pytest.raises(
        ValueError, match="images is not supported for the vision-language model_type 'gemma3'"
    ):
        qwen_vl.require_image_processor(SiglipImageProcessorPil(), "gemma3")
    with pytest.raises(ValueError, match="model with image processor SiglipImageProcessorPil"):
        qwen_vl.require_image_processor(SiglipImageProcessorPil())
