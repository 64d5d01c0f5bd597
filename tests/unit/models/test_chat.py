"""Chat encoding and image preprocessing with the tiny tokenizer (no model needed)."""

from __future__ import annotations

import pytest
from PIL import Image

from stagectl.models.chat import (
    DETECTION_INSTRUCTION,
    chat_template_ids,
    detection_messages,
    encode_answer_text,
    encode_messages,
    encode_prompt,
    encode_training,
    expand_image_pads,
)
from stagectl.models.images import build_image_processor, preprocess_images
from stagectl.models.tokenizer import IM_END, IMAGE_PAD, build_tiny_tokenizer, token_id

ANSWER = '{"object_1": {"desc": "red circle", "bbox_2d": ["<|coord_1|>", "<|coord_2|>", "<|coord_30|>", "<|coord_40|>"]}}'


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.mark.parametrize(
    ("patch_size", "size", "expected_grid"),
    [
        (14, (112, 112), [1, 8, 8]),  # 16 merged tokens
        (14, (168, 112), [1, 8, 12]),  # (width, height) -> grid (t, h, w)
        (14, (20, 20), [1, 4, 4]),  # scaled up to the minimum budget
        (14, (1000, 1000), [1, 16, 16]),  # scaled down to the maximum budget
        (16, (112, 112), [1, 8, 8]),  # Qwen3-VL patch size
    ],
)
def test_image_grid(patch_size: int, size: tuple[int, int], expected_grid: list[int]) -> None:
    processor = build_image_processor(patch_size)
    inputs = preprocess_images([Image.new("RGB", size, (255, 0, 0))], processor)
    assert inputs.image_grid_thw.tolist() == [expected_grid]
    t, h, w = expected_grid
    assert inputs.pixel_values.shape == (t * h * w, 3 * 2 * patch_size * patch_size)
    assert inputs.num_image_tokens == [t * h * w // 4]


def test_prompt_expands_one_pad_run_per_image(tok) -> None:
    processor = build_image_processor(14)
    images = [Image.new("RGB", (112, 112)), Image.new("L", (168, 112))]  # grayscale is converted to RGB
    prompt = encode_prompt(tok, processor, images)
    pad = token_id(tok, IMAGE_PAD)
    expected = [int(t * h * w) // 4 for t, h, w in prompt.image_grid_thw.tolist()]
    assert expected == [16, 24]
    # Two separate runs of pads, each as long as its image's merged grid, in image order.
    runs, current = [], 0
    for i in [*prompt.input_ids, -1]:
        if i == pad:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    assert runs == expected
    assert prompt.mm_token_type_ids == [int(i == pad) for i in prompt.input_ids]
    assert prompt.assistant_start == len(prompt.input_ids)
    text = tok.decode(prompt.input_ids)
    assert DETECTION_INSTRUCTION in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text.count("<|vision_start|>") == 2


def test_training_sample_appends_answer_and_end_of_turn(tok) -> None:
    prompt = encode_prompt(tok, build_image_processor(14), [Image.new("RGB", (112, 112))])
    answer_ids = encode_answer_text(tok, ANSWER)
    sample = encode_training(prompt, answer_ids, token_id(tok, IM_END))
    assert sample.input_ids[: sample.assistant_start] == prompt.input_ids
    assert sample.input_ids[sample.assistant_start :] == [*answer_ids, token_id(tok, IM_END)]
    assert tok.decode(sample.input_ids[sample.assistant_start : -1]) == ANSWER
    assert sample.mm_token_type_ids[sample.assistant_start :] == [0] * (len(answer_ids) + 1)
    with pytest.raises(ValueError, match="prompt-only"):
        encode_training(sample, answer_ids, token_id(tok, IM_END))


def test_encode_messages_equals_encode_prompt_for_detection_messages(tok) -> None:
    processor = build_image_processor(14)
    images = [Image.new("RGB", (112, 112)), Image.new("RGB", (168, 112))]
    expected = encode_prompt(tok, processor, images)
    got = encode_messages(tok, processor, detection_messages(2), images)
    assert got.input_ids == expected.input_ids
    assert got.mm_token_type_ids == expected.mm_token_type_ids
    assert got.image_grid_thw is not None and got.image_grid_thw.tolist() == expected.image_grid_thw.tolist()


def test_encode_messages_text_only(tok) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "red circle"}]
    prompt = encode_messages(tok, None, messages, [])
    assert prompt.input_ids == chat_template_ids(tok, messages)
    assert prompt.pixel_values is None and prompt.mm_token_type_ids is None
    assert tok.decode(prompt.input_ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nred circle<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="text-only"):
        encode_messages(tok, None, detection_messages(1), [Image.new("RGB", (56, 56))])


def test_expand_image_pads_checks_the_count(tok) -> None:
    pad = token_id(tok, IMAGE_PAD)
    assert expand_image_pads(tok, [5, pad, 6, pad], [2, 3]) == [5, pad, pad, 6, pad, pad, pad]
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        expand_image_pads(tok, [5, pad], [2, 3])
