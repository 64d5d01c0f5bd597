"""Chat encoding of one detection sample, shared by training (teacher forcing) and rollouts (`generate`),
and of any chat (`encode_messages`, what the rollout server's engines encode requests with).

Prompt = the checkpoint's chat template over one user turn `[image, ..., instruction]` with the
generation prompt (`<|im_start|>assistant\\n`) appended; each `<|image_pad|>` placeholder is expanded
in token space to the number of merged vision tokens of its image. A training sample appends the
assistant answer ids and the end-of-turn id (`<|im_end|>`). Prompt and answer are tokenised
separately, exactly as a rollout sees them (prompt ids in, generated ids out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from transformers import PreTrainedTokenizerBase
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from stagectl.models.corpus import DETECTION_INSTRUCTION
from stagectl.models.generate import PromptInputs
from stagectl.models.images import ImageInputs, preprocess_images
from stagectl.models.tokenizer import IM_END, IMAGE_PAD, token_id

__all__ = [
    "DETECTION_INSTRUCTION",
    "EncodedSample",
    "chat_template_ids",
    "encode_answer_text",
    "encode_messages",
    "encode_prompt",
    "encode_training",
    "expand_image_pads",
]


@dataclass(frozen=True)
class EncodedSample:
    """Token ids of one sample plus its image tensors.

    `input_ids[:assistant_start]` is the prompt; for a training sample `input_ids[assistant_start:]` is
    the answer followed by the end-of-turn id, for a prompt `assistant_start == len(input_ids)`.
    """

    input_ids: list[int]
    mm_token_type_ids: list[int]  # aligned with input_ids: 0 text, 1 image token
    assistant_start: int
    images: ImageInputs

    @property
    def pixel_values(self) -> torch.Tensor:  # (num_patches, patch_dim)
        return self.images.pixel_values

    @property
    def image_grid_thw(self) -> torch.Tensor:  # (num_images, 3)
        return self.images.image_grid_thw


def detection_messages(num_images: int, instruction: str = DETECTION_INSTRUCTION) -> list[dict]:
    """One user turn: the images (in order), then the instruction text."""
    content: list[dict] = [{"type": "image"} for _ in range(num_images)]
    content.append({"type": "text", "text": instruction})
    return [{"role": "user", "content": content}]


def chat_template_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    """The chat template over `messages` plus the generation prompt, as ids (one `<|image_pad|>` per image)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    return list(tokenizer.encode(text, add_special_tokens=False))


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


def encode_messages(
    tokenizer: PreTrainedTokenizerBase,
    image_processor: Qwen2VLImageProcessorPil | None,
    messages: list[dict[str, Any]],
    images: Sequence[Image.Image],
) -> PromptInputs:
    """Generation prompt of any chat (template-ready `messages`, images in placeholder order); for
    detection messages the ids equal `encode_prompt`'s. `image_processor` None: a text-only model,
    which takes no images (`ValueError`)."""
    template_ids = chat_template_ids(tokenizer, messages)
    if not images:
        return PromptInputs(template_ids)
    if image_processor is None:
        raise ValueError(f"the model is text-only and cannot take images ({len(images)} given)")
    inputs = preprocess_images(list(images), image_processor)
    ids = expand_image_pads(tokenizer, template_ids, inputs.num_image_tokens)
    image_pad_id = token_id(tokenizer, IMAGE_PAD)
    return PromptInputs(
        ids, [int(i == image_pad_id) for i in ids], inputs.pixel_values, inputs.image_grid_thw
    )


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    image_processor: Qwen2VLImageProcessorPil,
    images: Sequence[Image.Image],
    instruction: str = DETECTION_INSTRUCTION,
) -> EncodedSample:
    """The generation prompt of one sample (what a rollout is conditioned on)."""
    image_inputs = preprocess_images(list(images), image_processor)
    template_ids = chat_template_ids(tokenizer, detection_messages(len(images), instruction))
    ids = expand_image_pads(tokenizer, template_ids, image_inputs.num_image_tokens)
    image_pad_id = token_id(tokenizer, IMAGE_PAD)
    return EncodedSample(
        input_ids=ids,
        mm_token_type_ids=[int(i == image_pad_id) for i in ids],
        assistant_start=len(ids),
        images=image_inputs,
    )


def encode_answer_text(tokenizer: PreTrainedTokenizerBase, answer: str) -> list[int]:
    """Assistant text -> ids, without special-token wrapping (coordinate tokens become single ids)."""
    return list(tokenizer.encode(answer, add_special_tokens=False))


def encode_training(prompt: EncodedSample, answer_ids: Sequence[int], end_of_turn_id: int) -> EncodedSample:
    """`prompt` + answer ids + end-of-turn: one teacher-forced sample."""
    if prompt.assistant_start != len(prompt.input_ids):
        raise ValueError("encode_training needs a prompt-only sample (it already has an answer)")
    tail = [*answer_ids, end_of_turn_id]
    return EncodedSample(
        input_ids=[*prompt.input_ids, *tail],
        mm_token_type_ids=[*prompt.mm_token_type_ids, *([0] * len(tail))],
        assistant_start=prompt.assistant_start,
        images=prompt.images,
    )


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that closes an assistant turn (`<|im_end|>`)."""
    return token_id(tokenizer, IM_END)
