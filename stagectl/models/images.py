"""Image preprocessing for Qwen-VL models with pillow and numpy only (torchvision is not a dependency).

Wraps transformers' `Qwen2VLImageProcessorPil` (used by Qwen2-VL, Qwen2.5-VL and Qwen3-VL): resize so
both sides are multiples of `patch_size * merge_size` within a pixel budget, normalise, and cut into
flattened patches. Output: `pixel_values` (num_patches, C * temporal_patch * patch * patch) and
`image_grid_thw` (num_images, 3); image `i` takes `prod(grid_thw[i]) // merge_size**2` `<|image_pad|>`
tokens in the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

MERGE_SIZE = 2
# Tiny-model pixel budget, in merged tokens per side: a 112 x 112 image (patch 14) -> 4 x 4 = 16 tokens,
# anything is scaled into [2 x 2, 8 x 8] tokens.
TINY_MIN_TOKENS_PER_SIDE = 2
TINY_MAX_TOKENS_PER_SIDE = 8


@dataclass(frozen=True)
class ImageInputs:
    """Preprocessed images of one sample, ready for the vision tower."""

    pixel_values: torch.Tensor  # (num_patches, patch_dim) float32
    image_grid_thw: torch.Tensor  # (num_images, 3) int64
    num_image_tokens: list[int]  # <|image_pad|> count per image (after the spatial merge)


def build_image_processor(patch_size: int) -> Qwen2VLImageProcessorPil:
    """The tiny models' image processor: small pixel budget, Qwen defaults otherwise."""
    side = patch_size * MERGE_SIZE
    return Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        min_pixels=(side * TINY_MIN_TOKENS_PER_SIDE) ** 2,
        max_pixels=(side * TINY_MAX_TOKENS_PER_SIDE) ** 2,
    )


def load_image_processor(model_dir: str | Path) -> Qwen2VLImageProcessorPil:
    """The pillow image processor saved with a checkpoint (`preprocessor_config.json`)."""
    return Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))


def open_rgb(path: str | Path) -> Image.Image:
    """Open an image file as RGB; `FileNotFoundError` names the path."""
    image_path = Path(path)
    if not image_path.is_file():
        raise FileNotFoundError(f"image not found: {image_path}")
    with Image.open(image_path) as image:
        return image.convert("RGB")


def preprocess_images(images: list[Image.Image], processor: Qwen2VLImageProcessorPil) -> ImageInputs:
    """Resize, normalise and patchify `images` (in prompt order)."""
    if not images:
        raise ValueError("preprocess_images needs at least one image")
    out = processor(images=[image.convert("RGB") for image in images], return_tensors="pt")
    pixel_values = out["pixel_values"].to(torch.float32)
    grid = out["image_grid_thw"].to(torch.int64)
    merge = processor.merge_size
    num_tokens = [int(t * h * w) // (merge * merge) for t, h, w in grid.tolist()]
    return ImageInputs(pixel_values=pixel_values, image_grid_thw=grid, num_image_tokens=num_tokens)
