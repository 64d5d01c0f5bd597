"""The `hf` engine serving the text-only tiny Qwen2 (the model the vLLM tier uses) behind the real app on
127.0.0.1 (in a thread): greedy ids equal local `generate_batch`, stop strings cut ids and text, images
are refused with a 400 that says why, and a weight sync is served token for token."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import torch
from PIL import Image

from stagectl.engines.hf import HFEngine
from stagectl.engines.text import cut_at_stop
from stagectl.inference.client import RolloutClient, to_generation
from stagectl.models.chat import encode_messages
from stagectl.models.generate import SamplingSpec, generate_batch
from stagectl.models.loading import ModelBundle, load_bundle
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.weightsync.client import WeightSyncClient
from stagectl.wire.protocol import InferRequest, Message, RequestConfig

MODEL = "builtin:tiny-qwen2"
MAX_TOKENS = 24
GREEDY = RequestConfig(max_tokens=MAX_TOKENS, temperature=0.0, return_details=True)
TEXTS = ["Hello world", "red circle", "count the shapes"]

pytestmark = pytest.mark.integration


@dataclass
class Served:
    url: str
    mirror: ModelBundle  # its own copy of the weights (the engine's model is a separate load)

    def local_greedy(self, text: str) -> list[int]:
        prompt = encode_messages(self.mirror.tokenizer, None, [{"role": "user", "content": text}], [])
        pad = int(self.mirror.tokenizer.pad_token_id)
        (generation,) = generate_batch(
            self.mirror.model,
            [prompt],
            SamplingSpec(max_new_tokens=MAX_TOKENS, temperature=0.0),
            stop_token_ids=[self.mirror.end_of_turn_id, pad],
            pad_token_id=pad,
        )
        return generation.token_ids

    def decode(self, ids: list[int]) -> str:
        return str(self.mirror.tokenizer.decode(ids, skip_special_tokens=True))


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    engine = HFEngine(load_bundle(MODEL), model_name=MODEL, max_batch_size=4, batch_wait_ms=10)
    server = ThreadedServer(build_app(RolloutService(engine, ServerSettings()))).start()
    yield Served(server.url, load_bundle(MODEL))
    server.stop()


def _request(text: str) -> InferRequest:
    return InferRequest(messages=[Message(role="user", content=text)])


def test_text_requests_match_local_greedy(served: Served) -> None:
    assert served.mirror.image_processor is None
    with RolloutClient([served.url]) as client:
        outs = client.infer([_request(t) for t in TEXTS], GREEDY)
    for text, out in zip(TEXTS, outs, strict=True):
        assert to_generation(out).token_ids == served.local_greedy(text)
        assert out.choices[0].message.content == served.decode(out.choices[0].token_ids or [])


def test_stop_string(served: Served) -> None:
    full = served.local_greedy(TEXTS[0])
    text = served.decode(full)
    stop = next(text[i : i + 2] for i in range(len(text) // 3, len(text)) if text[i : i + 2].isalpha())
    expected_ids, expected_text, hit = cut_at_stop(full, [stop], served.decode)
    assert hit
    config = RequestConfig(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop], return_details=True)
    with RolloutClient([served.url]) as client:
        (out,) = client.infer([_request(TEXTS[0])], config)
    assert out.choices[0].token_ids == expected_ids
    assert out.choices[0].message.content == expected_text == text[: text.find(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_images_are_refused_with_a_reason(served: Served) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56)).save(buffer, format="PNG")
    inline = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    body = {
        "infer_requests": [{"messages": [{"role": "user", "content": "<image>what?"}], "images": [inline]}]
    }
    response = httpx.post(f"{served.url}/infer/", json=body)
    assert response.status_code == 400 and "text-only" in response.json()["detail"]


def test_weight_sync_is_served(served: Served) -> None:
    old = served.local_greedy(TEXTS[1])
    with torch.no_grad():
        for param in served.mirror.model.parameters():
            param.mul_(-1.0)  # a large, exactly representable change
    expected = served.local_greedy(TEXTS[1])
    assert expected != old
    with RolloutClient([served.url]) as client, WeightSyncClient([served.url], chunk_bytes=1 << 20) as pusher:
        version = pusher.versions()[0].version
        pusher.push_weights(served.mirror.model.state_dict(), version + 1)
        (out,) = client.infer([_request(TEXTS[1])], GREEDY)
    assert to_generation(out).token_ids == expected and out.version == version + 1


def test_prompt_plus_max_tokens_beyond_the_models_context_is_400(served: Served) -> None:
    max_len = int(served.mirror.model.config.get_text_config().max_position_embeddings)
    body = {
        "infer_requests": [{"messages": [{"role": "user", "content": TEXTS[0]}]}],
        "request_config": {"max_tokens": max_len - 2},  # under the server's cap, over the context
    }
    response = httpx.post(f"{served.url}/infer/", json=body, timeout=60)
    assert response.status_code == 400
    detail = response.json()["detail"]
    assert f"max_tokens {max_len - 2}" in detail and f"max_model_len of {max_len} tokens" in detail
