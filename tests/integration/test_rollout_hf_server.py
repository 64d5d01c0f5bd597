"""`stagectl rollout-server` with the tiny Qwen2.5-VL and the `hf` engine, as a real subprocess on
127.0.0.1 (port 0, address read from its output): token ids, batching under concurrency, weight sync
from a model trained a few steps, a killed sync, a bad checksum, a wrong token, graceful SIGTERM."""

from __future__ import annotations

import base64
import io
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from stagectl.inference.client import RolloutClient, detection_request, to_generation
from stagectl.models.chat import encode_answer_text, encode_prompt
from stagectl.models.generate import PromptInputs, SamplingSpec, generate_batch
from stagectl.models.loading import ModelBundle, load_bundle
from stagectl.server.app import STOPPED_LINE
from stagectl.server.launcher import start_server_process
from stagectl.weightsync.client import WeightSyncClient
from stagectl.weightsync.errors import WeightPushError
from stagectl.weightsync.wire import encode_chunks
from stagectl.wire.protocol import InferRequest, RequestConfig
from tests.integration.helpers import ROOT, run_cli

MODEL = "builtin:tiny-qwen2.5-vl"
TOKEN = "tiny-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INSTRUCTION = "Find every object."
MAX_TOKENS = 12
GREEDY = RequestConfig(max_tokens=MAX_TOKENS, temperature=0.0, return_details=True)


@dataclass
class Served:
    url: str
    mirror: ModelBundle  # a local copy whose weights always equal the server's
    images: list[Path]
    version: int = 0

    def prompt(self, index: int) -> PromptInputs:
        image = Image.open(self.images[index]).convert("RGB")
        p = encode_prompt(self.mirror.tokenizer, self.mirror.image_processor, [image], INSTRUCTION)
        return PromptInputs(p.input_ids, p.mm_token_type_ids, p.pixel_values, p.image_grid_thw)

    def local_greedy(self, index: int) -> list[int]:
        (generation,) = generate_batch(
            self.mirror.model,
            [self.prompt(index)],
            SamplingSpec(max_new_tokens=MAX_TOKENS, temperature=0.0),
            stop_token_ids=[self.mirror.end_of_turn_id, int(self.mirror.tokenizer.pad_token_id)],
            pad_token_id=int(self.mirror.tokenizer.pad_token_id),
        )
        return generation.token_ids

    def request(self, index: int) -> InferRequest:
        return detection_request([self.images[index]], INSTRUCTION)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("rollout_images")
    rng = np.random.default_rng(0)
    images = []
    for k in range(8):
        side = (56, 84, 112, 140)[k % 4]
        path = root / f"img{k}.png"
        Image.fromarray(rng.integers(0, 255, (side, side + 28 * (k % 2), 3), dtype=np.uint8)).save(path)
        images.append(path)
    server = start_server_process(
        [
            "--model", MODEL, "--port", "0",
            "--set", f"rollout_server.image_roots=[{root}]",
            "--set", "rollout_server.max_batch_size=8",
            "--set", "rollout_server.batch_wait_ms=50",
            "--set", "rollout_server.auth_token_env=STAGECTL_TEST_ROLLOUT_TOKEN",
            "--set", "rollout_server.max_requests_per_call=4",
        ],
        env={"STAGECTL_TEST_ROLLOUT_TOKEN": TOKEN},
        cwd=ROOT,
        timeout_s=300,
    )  # fmt: skip
    mirror = load_bundle(MODEL)
    assert server.url is not None and server.url.startswith("http://127.0.0.1:")
    yield Served(server.url, mirror, images)
    # SIGTERM: uvicorn finishes in-flight requests, runs the shutdown (engine closed), then re-raises the signal.
    assert server.stop() in (0, -signal.SIGTERM), "\n".join(server.tail)
    assert any(STOPPED_LINE in line for line in server.tail)


@pytest.fixture
def client(served: Served) -> Iterator[RolloutClient]:
    with RolloutClient([served.url], auth_token=TOKEN) as c:
        c.wait_healthy(timeout_s=30)
        yield c


@pytest.fixture
def pusher(served: Served) -> Iterator[WeightSyncClient]:
    with WeightSyncClient([served.url], auth_token=TOKEN, chunk_bytes=1 << 20) as p:
        yield p


def test_token_ids_decode_to_text_and_prompt_matches_the_learner(
    served: Served, client: RolloutClient
) -> None:
    config = RequestConfig(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, return_details=True)
    (out,) = client.infer([served.request(0)], config)
    choice = out.choices[0]
    assert choice.token_ids and len(choice.token_ids) <= MAX_TOKENS
    assert (
        served.mirror.tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.message.content
    )
    assert out.prompt_token_ids == served.prompt(0).input_ids  # the learner's own prompt encoding
    assert choice.finish_reason in ("stop", "length")
    again = client.infer([served.request(0)], config)[0].choices[0].token_ids
    assert again == choice.token_ids  # same seed, same sample


def test_concurrent_clients_get_their_own_greedy_outputs(served: Served) -> None:
    expected = {k: served.local_greedy(k) for k in range(8)}
    before = httpx.get(f"{served.url}/stats/", headers=AUTH).json()["batch_sizes"]
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def one_client(k: int) -> None:
        try:
            with RolloutClient([served.url], auth_token=TOKEN) as c:
                out = c.infer([served.request((k + j) % 8) for j in range(4)], GREEDY)
                results[k] = [to_generation(r).token_ids for r in out]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one_client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(8):
        assert results[k] == [expected[(k + j) % 8] for j in range(4)], k
    after = httpx.get(f"{served.url}/stats/", headers=AUTH).json()["batch_sizes"]
    new = {int(size): count - before.get(size, 0) for size, count in after.items()}
    assert sum(size * count for size, count in new.items()) == 32
    assert (
        max(size for size, count in new.items() if count > 0) > 4
    )  # requests of several clients shared a batch


def _train_a_few_steps(bundle: ModelBundle, prompt: PromptInputs, target: str) -> None:
    """Three real SGD steps of teacher-forced CE toward `target` after the prompt."""
    model = bundle.model
    answer = [*encode_answer_text(bundle.tokenizer, target), bundle.end_of_turn_id]
    ids = torch.tensor([[*prompt.input_ids, *answer]])
    labels = torch.full_like(ids, -100)
    labels[0, len(prompt.input_ids) :] = torch.tensor(answer)
    mm = torch.tensor([[*(prompt.mm_token_type_ids or []), *([0] * len(answer))]])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    for _ in range(3):
        optimizer.zero_grad()
        out = model(
            input_ids=ids,
            mm_token_type_ids=mm,
            pixel_values=prompt.pixel_values,
            image_grid_thw=prompt.image_grid_thw,
            labels=labels,
            use_cache=False,
        )
        out.loss.backward()
        optimizer.step()
    model.eval()


def test_push_weights_from_a_trained_model(
    served: Served, client: RolloutClient, pusher: WeightSyncClient
) -> None:
    (before,) = client.infer([served.request(1)], GREEDY)
    old_ids = to_generation(before).token_ids
    assert old_ids == served.local_greedy(1)
    version = client.versions()[0].version
    _train_a_few_steps(served.mirror, served.prompt(1), "red circle blue square")
    local = served.local_greedy(1)
    assert local != old_ids  # the training really moved the greedy output
    report = pusher.push_weights(served.mirror.model.state_dict(), version + 1)
    assert report.num_chunks > 1 and report.transport == "http"
    assert client.versions()[0].version == version + 1
    (after,) = client.infer([served.request(1)], GREEDY)
    assert to_generation(after).token_ids == local  # token for token
    assert after.version == version + 1


def test_killed_sync_bad_checksum_and_wrong_token_keep_the_old_weights(
    served: Served, client: RolloutClient
) -> None:
    version = client.versions()[0].version
    (before,) = client.infer([served.request(2)], GREEDY)
    perturbed = {name: t + 1.0 for name, t in served.mirror.model.state_dict().items()}
    chunks = list(encode_chunks(perturbed, 1 << 20))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for chunk in chunks[: len(chunks) // 2]:  # the learner dies half-way
        params = {
            "sync_id": "killed",
            "chunk_index": chunk.index,
            "digest": chunk.digest,
            "version": version + 1,
        }
        assert httpx.post(
            f"{served.url}/update_weights/", params=params, content=chunk.data, headers=auth
        ).is_success
    params = {"sync_id": "corrupt", "chunk_index": 0, "digest": "0" * 32, "version": version + 1}
    response = httpx.post(
        f"{served.url}/update_weights/", params=params, content=chunks[0].data, headers=auth
    )
    assert response.status_code == 400 and "checksum mismatch" in response.json()["detail"]
    with (
        WeightSyncClient([served.url], auth_token="wrong") as intruder,
        pytest.raises(WeightPushError, match="HTTP 401"),
    ):
        intruder.push_weights(perturbed, version + 1)
    assert client.versions()[0].version == version
    (after,) = client.infer([served.request(2)], GREEDY)
    assert after.choices[0].token_ids == before.choices[0].token_ids


def test_unencodable_image_is_400(served: Served) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (3000, 10)).save(buffer, format="PNG")
    inline = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    body = {"infer_requests": [{"messages": [{"role": "user", "content": "<image>x"}], "images": [inline]}]}
    response = httpx.post(f"{served.url}/infer/", headers=AUTH, json=body)
    # refused before the engine (the processor's limit), naming the image and why
    assert response.status_code == 400
    assert "inline image: 3000x10 is more than 200 times as long as it is wide" in response.json()["detail"]


def test_the_cli_server_applies_its_configured_bounds_and_token(served: Served) -> None:
    body = {"infer_requests": [{"messages": [{"role": "user", "content": "hi"}]}] * 5}
    response = httpx.post(f"{served.url}/infer/", headers=AUTH, json=body)
    assert response.status_code == 413 and "at most 4" in response.json()["detail"]
    body = {
        **body,
        "infer_requests": body["infer_requests"][:1],
        "request_config": {"max_tokens": 10_000_000},
    }
    response = httpx.post(f"{served.url}/infer/", headers=AUTH, json=body)
    assert response.status_code == 400 and "cap of 8192" in response.json()["detail"]
    assert httpx.post(f"{served.url}/infer/", json=body).status_code == 401
    assert httpx.get(f"{served.url}/health/").status_code == 200


def test_beyond_loopback_needs_a_token() -> None:
    result = run_cli("rollout-server", "--model", MODEL, "--host", "0.0.0.0", "--port", "0", timeout=60)
    assert result.returncode == 1
    assert "rollout_server.auth_token_env" in result.stderr
