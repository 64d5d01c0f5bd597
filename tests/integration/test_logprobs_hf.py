"""Logprobs of in-process generation with the tiny Qwen2.5-VL (no subprocess): every generated token's
log-probability equals the teacher-forced log-softmax of the raw logits, in a left-padded batch and
with a repetition penalty (which changes the tokens, not the distribution reported); the `hf` engine
reports the same numbers as the learner's `generate_batch`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from stagectl.engines.hf import HFEngine
from stagectl.engines.interface import EngineRequest
from stagectl.models.chat import encode_prompt
from stagectl.models.generate import PromptInputs, SamplingSpec, generate_batch
from stagectl.models.loading import ModelBundle, load_bundle

MODEL = "builtin:tiny-qwen2.5-vl"
INSTRUCTION = "Find every object."
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_bundle(MODEL)


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((56, 56), (84, 112))
    ]


def _prompt(bundle: ModelBundle, image: Image.Image) -> PromptInputs:
    p = encode_prompt(bundle.tokenizer, bundle.image_processor, [image], INSTRUCTION)
    return PromptInputs(p.input_ids, p.mm_token_type_ids, p.pixel_values, p.image_grid_thw)


@torch.no_grad()
def _teacher_forced(bundle: ModelBundle, prompt: PromptInputs, generated: list[int]) -> list[float]:
    ids = torch.tensor([prompt.input_ids + generated])
    mm = torch.tensor([list(prompt.mm_token_type_ids or []) + [0] * len(generated)], dtype=torch.int)
    logits = bundle.model(
        input_ids=ids,
        pixel_values=prompt.pixel_values,
        image_grid_thw=prompt.image_grid_thw,
        mm_token_type_ids=mm,
    ).logits[0]  # (L, V)
    n = len(prompt.input_ids)
    logp = torch.log_softmax(logits[n - 1 : n - 1 + len(generated)].float(), dim=-1)
    return logp.gather(-1, torch.tensor(generated).unsqueeze(-1)).squeeze(-1).tolist()


@pytest.mark.parametrize("repetition_penalty", [1.0, 1.8])
def test_generate_batch_logprobs_are_the_raw_teacher_forced_ones(
    bundle: ModelBundle, repetition_penalty: float
) -> None:
    prompts = [_prompt(bundle, image) for image in _images()]  # different lengths: left padding
    spec = SamplingSpec(max_new_tokens=MAX_TOKENS, temperature=0.0, repetition_penalty=repetition_penalty)
    kwargs = {"stop_token_ids": bundle.stop_token_ids, "pad_token_id": int(bundle.tokenizer.pad_token_id)}
    plain = generate_batch(bundle.model, prompts, spec, **kwargs)  # type: ignore[arg-type]
    scored = generate_batch(
        bundle.model, prompts, SamplingSpec(**{**spec.__dict__, "logprobs": True}), **kwargs
    )  # type: ignore[arg-type]
    for prompt, without, generation in zip(prompts, plain, scored, strict=True):
        assert generation.token_ids == without.token_ids  # recording changes nothing about the decoding
        assert without.logprobs is None
        assert generation.logprobs is not None and len(generation.logprobs) == len(generation.token_ids)
        assert generation.logprobs == pytest.approx(
            _teacher_forced(bundle, prompt, generation.token_ids), abs=1e-4
        )
        assert all(lp <= 0 for lp in generation.logprobs)


def test_hf_engine_reports_the_same_logprobs_as_generate_batch(bundle: ModelBundle) -> None:
    image = _images()[1]
    spec = SamplingSpec(max_new_tokens=MAX_TOKENS, temperature=0.0, logprobs=True)
    (local,) = generate_batch(
        bundle.model,
        [_prompt(bundle, image)],
        spec,
        stop_token_ids=bundle.stop_token_ids,
        pad_token_id=int(bundle.tokenizer.pad_token_id),
    )
    engine = HFEngine(bundle, model_name="tiny", max_batch_size=4, batch_wait_ms=0)
    try:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": INSTRUCTION}]}]
        (result,) = engine.generate([EngineRequest(messages, [image], spec, seed=None)])
    finally:
        engine.close()
    assert result.token_ids == local.token_ids
    assert result.logprobs == pytest.approx(local.logprobs, abs=1e-5)
    assert result.token_bytes is not None
    assert b"".join(result.token_bytes).decode("utf-8", errors="replace") == bundle.tokenizer.decode(
        result.token_ids, skip_special_tokens=False
    )
