"""The production rollout path on this CPU: `stagectl rollout-server --engine vllm` serving the tiny Qwen2.5-VL
and Qwen3-VL with images (one server per model, run by the vLLM environment's interpreter), checked against
transformers in this environment (the `hf` engine's encoding and generation): the same greedy ids for the
same image prompts, coordinate tokens as single ids, a weight sync (vision tower included) that serves the
new weights, and vLLM's per-token log-probabilities (`vlm_logprobs.py`, one more vLLM start) equal to the
ones transformers computes for the same tokens."""

from __future__ import annotations

import base64
import io
import json
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from stagectl.inference.client import RolloutClient, to_generation
from stagectl.models.chat import encode_messages
from stagectl.models.generate import PromptInputs, SamplingSpec, generate_batch
from stagectl.models.loading import ModelBundle, checkpoint_stop_ids, load_bundle, resolve_model_path
from stagectl.models.tokenizer import coord_token_ids
from stagectl.server.launcher import ServerProcess
from stagectl.weightsync.client import WeightSyncClient
from stagectl.wire.protocol import ContentItem, InferRequest, Message, RequestConfig
from tests.vllm.helpers import ROOT, require_vllm_python

MODELS = ["builtin:tiny-qwen2.5-vl", "builtin:tiny-qwen3-vl"]
MAX_TOKENS = 24
GREEDY = RequestConfig(max_tokens=MAX_TOKENS, temperature=0.0, return_details=True)
# |vLLM logprob - transformers logprob| allowed per prompt, from what this CPU gave (max over 24 tokens). Qwen2.5-VL:
# 4.8e-7 on the two images on the 28-pixel grid; 6.4e-4 on the resized one (vLLM preprocesses with the
# checkpoint's torchvision-backed image processor, the hf engine with the PIL one: they resample differently).
# Qwen3-VL: 7.3e-5, 3.8e-3 (the non-square 84 x 140 image, no resize), 2.5e-4: source not found (vLLM's own
# Qwen3-VL vision code; its position-embedding interpolation is a suspect). Greedy ids are equal throughout.
LOGPROB_ATOL = {"builtin:tiny-qwen2.5-vl": (1e-5, 1e-5, 2e-3), "builtin:tiny-qwen3-vl": (5e-4, 1e-2, 1e-3)}
# (width, height, text): sizes on and off the 28-pixel grid (the latter are resized by the processor).
PROMPTS = [(112, 112, "Find every object."), (84, 140, "red circle"), (100, 70, "count the shapes")]


def image(index: int) -> Image.Image:
    width, height, _ = PROMPTS[index]
    pixels = np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)
    pixels[height // 4 : height // 2, width // 4 : width // 2] = (255, 0, 0)  # some structure, not just noise
    return Image.fromarray(pixels)


def data_url(picture: Image.Image) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def request(index: int) -> InferRequest:
    text = PROMPTS[index][2]
    items = [ContentItem(type="image"), ContentItem(type="text", text=text)]
    return InferRequest(messages=[Message(role="user", content=items)], images=[data_url(image(index))])


@dataclass
class Served:
    model: str
    url: str
    mirror: ModelBundle  # a local transformers copy whose weights always equal the server's
    stop_ids: list[int]

    def prompt(self, index: int) -> PromptInputs:
        text = PROMPTS[index][2]
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        return encode_messages(
            self.mirror.tokenizer,
            self.mirror.image_processor,
            messages,
            [image(index)],
            model_type=self.mirror.model.config.model_type,
        )

    def local_greedy(self, index: int) -> list[int]:
        (generation,) = generate_batch(
            self.mirror.model,
            [self.prompt(index)],
            SamplingSpec(max_new_tokens=MAX_TOKENS, temperature=0.0),
            stop_token_ids=self.stop_ids,
            pad_token_id=int(self.mirror.tokenizer.pad_token_id),
        )
        return generation.token_ids


@pytest.fixture(scope="module", params=MODELS)
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    python = require_vllm_python()
    model = str(request.param)
    mirror = load_bundle(model)  # builds the cached checkpoint the server then only loads
    _, stop_ids = checkpoint_stop_ids(resolve_model_path(model), mirror.tokenizer)
    argv = [
        str(python),
        "-m",
        "stagectl",
        "rollout-server",
        "--engine",
        "vllm",
        "--port",
        "0",
        "--model",
        model,
    ]
    for setting in ("vllm.kv_cache_mb=64", "vllm.max_model_len=1024", "max_batch_size=4", "batch_wait_ms=50"):
        argv += ["--set", f"rollout_server.{setting}"]
    # One thread bound to core 0: vLLM's results then do not depend on how many cores the machine has.
    server = ServerProcess(argv, env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, cwd=ROOT)
    server.wait_listening(timeout_s=300)
    assert server.url is not None
    yield Served(model, server.url, mirror, stop_ids)
    assert server.stop() in (0, -signal.SIGTERM), "\n".join(server.tail)


@pytest.fixture
def client(served: Served) -> Iterator[RolloutClient]:
    with RolloutClient([served.url]) as c:
        c.wait_healthy(timeout_s=60)
        yield c


@pytest.fixture
def pusher(served: Served) -> Iterator[WeightSyncClient]:
    with WeightSyncClient([served.url], chunk_bytes=1 << 20) as p:
        yield p


def test_image_prompts_give_transformers_greedy_ids(served: Served, client: RolloutClient) -> None:
    (version,) = client.versions()
    assert (version.engine, version.model) == ("vllm", served.model)
    outs = client.infer([request(k) for k in range(len(PROMPTS))], GREEDY)
    for k, out in enumerate(outs):
        # The hf engine's encoding: vLLM expands each <|image_pad|> to the image's token count the same way.
        assert out.prompt_token_ids == served.prompt(k).input_ids, k
        assert out.choices[0].token_ids == served.local_greedy(k), k
    distinct = {tuple(out.choices[0].token_ids or []) for out in outs}
    assert len(distinct) == len(PROMPTS)  # the images (not only the text) steer the answers


def test_an_image_too_large_for_the_context_fails_its_own_call_only(served: Served) -> None:
    """150 images of 112 x 112 are at least 1,350 image tokens, past `max_model_len` 1024, which only vLLM
    counts (the server's context check sees one placeholder per image). vLLM refused the call inside the
    batched generate: every call in that batch got a plain-text 500; now that call gets a 400 saying why
    and the others their answers."""
    blank = data_url(Image.fromarray(np.zeros((112, 112, 3), dtype=np.uint8)))
    answers: dict[int, httpx.Response] = {}

    def call(k: int) -> None:
        item = request(k % len(PROMPTS)).model_dump(mode="json", exclude_none=True)
        if k == 1:
            item["images"] = [blank] * 150
            item["messages"][0]["content"] = [{"type": "image"}] * 150 + [{"type": "text", "text": "x"}]
        body = {"infer_requests": [item], "request_config": {"max_tokens": 4, "temperature": 0}}
        answers[k] = httpx.post(f"{served.url}/infer/", json=body, timeout=300)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [answers[k].status_code for k in range(3)] == [200, 400, 200], answers[1].text
    assert "vLLM refuses the request" in answers[1].json()["detail"]
    assert "maximum model length of 1024" in answers[1].json()["detail"]


def test_coordinate_tokens_come_out_as_single_ids(served: Served, client: RolloutClient) -> None:
    coords = coord_token_ids(served.mirror.tokenizer)
    outs = client.infer([request(k) for k in range(len(PROMPTS))], GREEDY)
    generated = [tid for out in outs for tid in out.choices[0].token_ids or []]
    emitted = [tid for tid in generated if tid in set(coords)]
    assert emitted, "the random tiny model should emit some coordinate tokens"
    for tid in emitted:  # one id per coordinate, spelled as the tokenizer's own <|coord_N|> token
        text = served.mirror.tokenizer.convert_ids_to_tokens(tid)
        assert text == f"<|coord_{coords.index(tid)}|>"
        assert served.mirror.tokenizer.encode(text, add_special_tokens=False) == [tid]


def test_weight_sync_into_the_vlm_serves_the_new_weights(
    served: Served, client: RolloutClient, pusher: WeightSyncClient
) -> None:
    before = [to_generation(out).token_ids for out in client.infer([request(k) for k in range(3)], GREEDY)]
    version = client.versions()[0].version
    visual_before = _visual_weights(served.mirror)
    _train_a_few_steps(served, 0, "<|coord_10|><|coord_20|><|coord_300|><|coord_400|>")
    assert not torch.equal(_visual_weights(served.mirror), visual_before)  # the vision tower moved too
    local = [served.local_greedy(k) for k in range(3)]
    assert local != before  # the training really changed the greedy answers
    report = pusher.push_weights(served.mirror.model.state_dict(), version + 1)
    assert report.transport == "http"
    assert client.versions()[0].version == version + 1
    after = client.infer([request(k) for k in range(3)], GREEDY)
    assert [to_generation(out).token_ids for out in after] == local  # token for token
    assert {out.version for out in after} == {version + 1}


def test_vllm_logprobs_equal_transformers(served: Served, tmp_path: Path) -> None:
    """Greedy ids and each chosen token's log-probability from vLLM (`SamplingParams(logprobs=0)`) against
    one teacher-forced transformers forward over prompt + answer. The mirror may have been trained by the
    sync test: this compares against the checkpoint on disk, loaded afresh."""
    python = require_vllm_python()
    path = resolve_model_path(served.model)
    mirror = load_bundle(served.model)
    fresh = Served(served.model, served.url, mirror, served.stop_ids)
    argv = [str(python), "-m", "tests.vllm.vlm_logprobs", str(path), str(MAX_TOKENS)]
    for k in range(len(PROMPTS)):
        image(k).save(tmp_path / f"{k}.png")
        argv += [str(tmp_path / f"{k}.png"), PROMPTS[k][2]]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600, env=_env(env))
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(records) == len(PROMPTS)
    for k, record in enumerate(records):
        prompt = fresh.prompt(k)
        assert record["token_ids"] == fresh.local_greedy(k), k
        expected = _teacher_forced_logprobs(mirror, prompt, record["token_ids"])
        got = torch.tensor(record["logprobs"])
        print(f"{served.model} prompt {k}: max |logprob diff| {(got - expected).abs().max().item():.2e}")
        torch.testing.assert_close(
            got, expected, atol=LOGPROB_ATOL[served.model][k], rtol=0, msg=f"prompt {k}"
        )


def _visual_weights(bundle: ModelBundle) -> torch.Tensor:
    return next(p for name, p in bundle.model.named_parameters() if "visual" in name).detach().clone()


def _train_a_few_steps(served: Served, index: int, target: str) -> None:
    """Three real SGD steps of teacher-forced CE toward `target` after an image prompt (so the vision tower
    gets gradients too)."""
    bundle = served.mirror
    prompt = served.prompt(index)
    answer = [*bundle.tokenizer.encode(target, add_special_tokens=False), bundle.end_of_turn_id]
    ids = torch.tensor([[*prompt.input_ids, *answer]])
    labels = torch.full_like(ids, -100)
    labels[0, len(prompt.input_ids) :] = torch.tensor(answer)
    optimizer = torch.optim.SGD(bundle.model.parameters(), lr=0.5)
    bundle.model.train()
    for _ in range(3):
        optimizer.zero_grad()
        bundle.model(**_forward_inputs(prompt, answer), labels=labels, use_cache=False).loss.backward()
        optimizer.step()
    bundle.model.eval()


@torch.no_grad()
def _teacher_forced_logprobs(bundle: ModelBundle, prompt: PromptInputs, answer: list[int]) -> torch.Tensor:
    logits = bundle.model(**_forward_inputs(prompt, answer), use_cache=False).logits
    logits = logits[0, len(prompt.input_ids) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(answer)[:, None])[:, 0]


def _forward_inputs(prompt: PromptInputs, answer: list[int]) -> dict[str, torch.Tensor | None]:
    """Model inputs of prompt + answer (the answer is text: modality 0)."""
    assert prompt.mm_token_type_ids is not None
    return {
        "input_ids": torch.tensor([[*prompt.input_ids, *answer]]),
        "mm_token_type_ids": torch.tensor([[*prompt.mm_token_type_ids, *([0] * len(answer))]]),
        "pixel_values": prompt.pixel_values,
        "image_grid_thw": prompt.image_grid_thw,
    }


def _env(extra: dict[str, str]) -> dict[str, str]:
    import os

    return {**os.environ, **extra}
