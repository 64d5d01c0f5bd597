"""Chat encoding of one detection sample, shared by training (teacher forcing) and rollouts (`generate`),
and of any chat (`encode_messages`, what the rollout server's engines encode requests with).

Prompt = the checkpoint's own chat template over the messages with its generation prompt appended
(any chat model). Images are Qwen-VL only: each `<|image_pad|>` placeholder is expanded in token space
to the number of merged vision tokens of its image (`stagectl.models.qwen_vl`). A training sample
appends the assistant answer ids and the end-of-turn id (the template's, `<|im_end|>` for Qwen).
Prompt and answer are tokenised separately, exactly as a rollout sees them (prompt ids in, generated
ids out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jinja2 import TemplateError
from PIL import Image
from transformers import PreTrainedTokenizerBase
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from stagectl.models import qwen_vl
from stagectl.models.corpus import DETECTION_INSTRUCTION
from stagectl.models.generate import PromptInputs
from stagectl.models.images import ImageInputs
from stagectl.models.qwen_vl import expand_image_pads

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
    """The chat template over `messages` plus the generation prompt, as ids (one `<|image_pad|>` per image).

    A template that refuses a system turn (Gemma 2, Mistral v0.1, ...) gets the system text folded into
    the first user message, the way Gemma 3's own template does it; any other template error is raised."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError:
        folded = _fold_system_turn(messages)
        if folded is None:
            raise
        text = tokenizer.apply_chat_template(folded, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _fold_system_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """`[system S, user U, ...]` (text contents) -> `[user "S\n\nU", ...]`; None for any other shape."""
    if len(messages) < 2 or [m.get("role") for m in messages[:2]] != ["system", "user"]:
        return None
    system, user = messages[0]["content"], messages[1]["content"]
    if not isinstance(system, str) or not isinstance(user, str):
        return None
    return [{"role": "user", "content": f"{system}\n\n{user}"}, *messages[2:]]


def encode_messages(
    tokenizer: PreTrainedTokenizerBase,
    image_processor: Any | None,
    messages: list[dict[str, Any]],
    images: Sequence[Image.Image],
    *,
    model_type: str | None = None,
) -> PromptInputs:
    """Generation prompt of any chat (template-ready `messages`, images in placeholder order); for
    detection messages the ids equal `encode_prompt`'s. `image_processor` None: a text-only model,
    which takes no images (`ValueError`); another family's processor: `qwen_vl.unsupported_vlm`."""
    template_ids = chat_template_ids(tokenizer, messages)
    if not images:
        return PromptInputs(template_ids)
    if image_processor is None:
        raise ValueError(f"the model is text-only and cannot take images ({len(images)} given)")
    processor = qwen_vl.require_image_processor(image_processor, model_type)
    ids, mm_types, inputs = qwen_vl.encode_images(tokenizer, processor, template_ids, images)
    return PromptInputs(ids, mm_types, inputs.pixel_values, inputs.image_grid_thw)


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    image_processor: Qwen2VLImageProcessorPil,
    images: Sequence[Image.Image],
    instruction: str = DETECTION_INSTRUCTION,
) -> EncodedSample:
    """The generation prompt of one detection sample (what a rollout is conditioned on; Qwen-VL)."""
    template_ids = chat_template_ids(tokenizer, detection_messages(len(images), instruction))
    processor = qwen_vl.require_image_processor(image_processor)
    ids, mm_types, image_inputs = qwen_vl.encode_images(tokenizer, processor, template_ids, images)
    return EncodedSample(
        input_ids=ids, mm_token_type_ids=mm_types, assistant_start=len(ids), images=image_inputs
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
