"""`stagectl rollout-server --engine vllm` with the text-only tiny Qwen2, run by the vLLM CPU environment's
interpreter as a real subprocess on 127.0.0.1 (one server for the module), checked against transformers
in this environment: greedy ids token for token, per-request seeds, stop strings, a full weight sync
over http from a model trained a few steps, and a corrupt sync that leaves the old weights serving."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import torch

from stagectl.engines.text import cut_at_stop
from stagectl.inference.client import RolloutClient, to_generation
from stagectl.models.chat import encode_answer_text, encode_messages
from stagectl.models.generate import PromptInputs, SamplingSpec, generate_batch
from stagectl.models.loading import ModelBundle, load_bundle
from stagectl.server.app import STOPPED_LINE
from stagectl.server.launcher import ServerProcess
from stagectl.weightsync.client import WeightSyncClient
from stagectl.weightsync.errors import WeightPushError
from stagectl.weightsync.wire import encode_chunks
from stagectl.wire.protocol import InferRequest, Message, RequestConfig
from tests.vllm.helpers import ROOT, require_vllm_python

MODEL = "builtin:tiny-qwen2"
MAX_TOKENS = 40
GREEDY = RequestConfig(max_tokens=MAX_TOKENS, temperature=0.0, return_details=True)
TEXTS = [
    "Hello world",
    "red circle",
    "What is in the picture?",
    "Find every object.",
    "blue square at the top",
    "a",
    "count the shapes",
    "green triangle, left",
]


@dataclass
class Served:
    url: str
    mirror: ModelBundle  # a local transformers copy whose weights always equal the server's

    def prompt(self, index: int) -> PromptInputs:
        messages = [{"role": "user", "content": TEXTS[index]}]
        return encode_messages(self.mirror.tokenizer, None, messages, [])

    def local_greedy(self, index: int) -> list[int]:
        (generation,) = generate_batch(
            self.mirror.model,
            [self.prompt(index)],
            SamplingSpec(max_new_tokens=MAX_TOKENS, temperature=0.0),
            stop_token_ids=[self.mirror.end_of_turn_id, int(self.mirror.tokenizer.pad_token_id)],
            pad_token_id=int(self.mirror.tokenizer.pad_token_id),
        )
        return generation.token_ids

    def decode(self, ids: list[int]) -> str:
        return str(self.mirror.tokenizer.decode(ids, skip_special_tokens=True))


def request(index: int) -> InferRequest:
    return InferRequest(messages=[Message(role="user", content=TEXTS[index])])


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    python = require_vllm_python()
    # Both environments read the same cached build (STAGECTL_CACHE_DIR, set by tests/conftest.py);
    # building it here first means the server only ever loads it.
    mirror = load_bundle(MODEL)
    argv = [str(python), "-m", "stagectl", "rollout-server", "--engine", "vllm", "--port", "0"]  # fmt: skip
    argv += ["--model", MODEL]
    for setting in ("vllm.kv_cache_mb=64", "vllm.max_model_len=512", "max_batch_size=8", "batch_wait_ms=50"):
        argv += ["--set", f"rollout_server.{setting}"]
    # One thread bound to core 0: vLLM's results then do not depend on how many cores the machine has.
    server = ServerProcess(argv, env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, cwd=ROOT)
    server.wait_listening(timeout_s=300)
    assert server.url is not None
    yield Served(server.url, mirror)
    # SIGTERM: uvicorn finishes in-flight requests, runs the shutdown (engine closed), then re-raises it.
    assert server.stop() in (0, -signal.SIGTERM), "\n".join(server.tail)
    assert any(STOPPED_LINE in line for line in server.tail), "\n".join(server.tail)


@pytest.fixture
def client(served: Served) -> Iterator[RolloutClient]:
    with RolloutClient([served.url]) as c:
        c.wait_healthy(timeout_s=60)
        yield c


@pytest.fixture
def pusher(served: Served) -> Iterator[WeightSyncClient]:
    with WeightSyncClient([served.url], chunk_bytes=1 << 20) as p:
        yield p


def test_greedy_equals_transformers_token_for_token(served: Served, client: RolloutClient) -> None:
    (version,) = client.versions()
    assert (version.engine, version.model) == ("vllm", MODEL)
    outs = client.infer([request(k) for k in range(len(TEXTS))], GREEDY)
    for k, out in enumerate(outs):
        choice = out.choices[0]
        assert out.prompt_token_ids == served.prompt(k).input_ids  # the hf engine's chat encoding
        assert choice.token_ids == served.local_greedy(k), k
        assert choice.message.content == served.decode(choice.token_ids)
        ends_at_stop = choice.token_ids[-1] in (
            served.mirror.end_of_turn_id,
            served.mirror.tokenizer.pad_token_id,
        )
        assert choice.finish_reason == ("stop" if ends_at_stop else "length")
    assert sum(len(out.choices[0].token_ids or []) for out in outs) > 4 * MAX_TOKENS  # not trivially short


def test_logprobs_equal_transformers_raw_log_softmax(served: Served, client: RolloutClient) -> None:
    """`request_config.logprobs`: per generated token, the raw model log-probability (vLLM's
    `raw_logprobs`, `SamplingParams(logprobs=0)`), equal to the hf path's within float tolerance."""
    config = GREEDY.model_copy(update={"logprobs": True})
    outs = client.infer([request(k) for k in range(4)], config)
    for k, out in enumerate(outs):
        choice = out.choices[0]
        assert choice.logprobs is not None and choice.token_ids is not None
        assert len(choice.logprobs.content) == len(choice.token_ids)
        joined = b"".join(bytes(e.bytes or []) for e in choice.logprobs.content)
        text = served.mirror.tokenizer.decode(choice.token_ids, skip_special_tokens=False)
        assert joined.decode("utf-8", errors="replace") == text
        (local,) = generate_batch(
            served.mirror.model,
            [served.prompt(k)],
            SamplingSpec(max_new_tokens=MAX_TOKENS, temperature=0.0, logprobs=True),
            stop_token_ids=[served.mirror.end_of_turn_id, int(served.mirror.tokenizer.pad_token_id)],
            pad_token_id=int(served.mirror.tokenizer.pad_token_id),
        )
        assert choice.token_ids == local.token_ids, k
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx(local.logprobs, abs=2e-3), k
    assert GREEDY.logprobs is False and client.infer([request(0)], GREEDY)[0].choices[0].logprobs is None


def test_per_request_seeds_are_reproducible_alone_or_batched(client: RolloutClient) -> None:
    config = RequestConfig(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=7, return_details=True)
    batch = [to_generation(out).token_ids for out in client.infer([request(k) for k in range(4)], config)]
    assert [
        to_generation(out).token_ids for out in client.infer([request(k) for k in range(4)], config)
    ] == batch
    # Request i of a call samples with seed + i: request 2 alone with seed 9 is request 2 of the batch.
    alone = RequestConfig(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=9, return_details=True)
    assert to_generation(client.infer([request(2)], alone)[0]).token_ids == batch[2]
    other = RequestConfig(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1000, return_details=True)
    assert [
        to_generation(out).token_ids for out in client.infer([request(k) for k in range(4)], other)
    ] != batch


def test_concurrent_clients_share_batches(served: Served) -> None:
    before = httpx.get(f"{served.url}/stats/").json()["batch_sizes"]
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def one_client(k: int) -> None:
        try:
            with RolloutClient([served.url]) as c:
                out = c.infer([request(2 * k), request(2 * k + 1)], GREEDY)
                results[k] = [to_generation(r).token_ids for r in out]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one_client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [ids for k in range(4) for ids in results[k]] == [served.local_greedy(k) for k in range(8)]
    after = httpx.get(f"{served.url}/stats/").json()["batch_sizes"]
    new = {int(size): count - before.get(size, 0) for size, count in after.items()}
    assert sum(size * count for size, count in new.items()) == 8
    assert max(size for size, count in new.items() if count > 0) > 2  # several clients in one generate call


def test_a_call_vllm_refuses_fails_alone_not_the_calls_batched_with_it(served: Served) -> None:
    """vLLM checks sampling values itself (`temperature` within [0, 2] in 0.32): that check ran inside the
    batched generate, so one such call failed every call it shared the batch with (plain-text 500s)."""
    answers: dict[float, httpx.Response] = {}

    def call(temperature: float) -> None:
        body = {
            "infer_requests": [{"messages": [{"role": "user", "content": TEXTS[0]}]}],
            "request_config": {"max_tokens": 8, "temperature": temperature, "seed": 1},
        }
        answers[temperature] = httpx.post(f"{served.url}/infer/", json=body, timeout=120)

    threads = [threading.Thread(target=call, args=(t,)) for t in (0.0, 1000.0, 0.5, 1.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {t: a.status_code for t, a in answers.items()} == {0.0: 200, 1000.0: 400, 0.5: 200, 1.0: 200}
    assert "vLLM refuses the sampling parameters" in answers[1000.0].json()["detail"]
    assert "temperature" in answers[1000.0].json()["detail"]


def test_stop_strings_cut_text_and_ids(served: Served, client: RolloutClient) -> None:
    full = served.local_greedy(0)
    text = served.decode(full)
    stop = next(text[i : i + 2] for i in range(len(text) // 3, len(text)) if text[i : i + 2].isalpha())
    expected_ids, expected_text, hit = cut_at_stop(full, [stop], served.decode)
    assert hit and len(expected_ids) < len(full)
    config = RequestConfig(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop], return_details=True)
    (out,) = client.infer([request(0)], config)
    assert out.choices[0].token_ids == expected_ids  # ends with the token completing the stop string
    assert out.choices[0].message.content == expected_text == text[: text.find(stop)]
    assert out.choices[0].finish_reason == "stop"


def _train_a_few_steps(bundle: ModelBundle, prompt: PromptInputs, target: str) -> None:
    """Three real SGD steps of teacher-forced CE toward `target` after the prompt."""
    model = bundle.model
    answer = [*encode_answer_text(bundle.tokenizer, target), bundle.end_of_turn_id]
    ids = torch.tensor([[*prompt.input_ids, *answer]])
    labels = torch.full_like(ids, -100)
    labels[0, len(prompt.input_ids) :] = torch.tensor(answer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    for _ in range(3):
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
        optimizer.step()
    model.eval()


def test_weight_sync_over_http_serves_the_new_weights(
    served: Served, client: RolloutClient, pusher: WeightSyncClient
) -> None:
    before = [to_generation(out).token_ids for out in client.infer([request(k) for k in range(4)], GREEDY)]
    version = client.versions()[0].version
    _train_a_few_steps(served.mirror, served.prompt(1), "red circle blue square")
    local = [served.local_greedy(k) for k in range(4)]
    assert local[1] != before[1]  # the training really moved the greedy output
    report = pusher.push_weights(served.mirror.model.state_dict(), version + 1)
    assert report.num_chunks > 1 and report.transport == "http"
    assert client.versions()[0].version == version + 1
    after = client.infer([request(k) for k in range(4)], GREEDY)
    assert [to_generation(out).token_ids for out in after] == local  # token for token
    assert {out.version for out in after} == {version + 1}


def test_delta_sync_serves_the_new_weights(served: Served) -> None:
    """A full push, more training, then a delta (only the changed elements; vLLM gets the touched tensors
    whole from the server's staged base): greedy output equals the learner's, token for token."""
    with (
        WeightSyncClient([served.url], chunk_bytes=1 << 20, delta=True) as delta,
        RolloutClient([served.url]) as client,
    ):
        version = delta.versions()[0].version
        assert not delta.push_weights(
            served.mirror.model.state_dict(), version + 1, base_version=version
        ).delta
        _train_a_few_steps(served.mirror, served.prompt(2), "green triangle")
        local = [served.local_greedy(k) for k in range(4)]
        report = delta.push_weights(served.mirror.model.state_dict(), version + 2, base_version=version + 1)
        assert report.delta and delta.versions()[0].version == version + 2
        after = client.infer([request(k) for k in range(4)], GREEDY)
    assert [to_generation(out).token_ids for out in after] == local
    assert {out.version for out in after} == {version + 2}


def test_failed_sync_keeps_the_old_weights(
    served: Served, client: RolloutClient, pusher: WeightSyncClient
) -> None:
    version = client.versions()[0].version
    expected = served.local_greedy(3)
    perturbed = {name: t + 1.0 for name, t in served.mirror.model.state_dict().items()}
    chunks = list(encode_chunks(perturbed, 1 << 20))
    for chunk in chunks[:-1]:  # every chunk but the last arrives intact, then a corrupt one
        params = {
            "sync_id": "corrupt",
            "chunk_index": chunk.index,
            "digest": chunk.digest,
            "version": version + 1,
        }
        assert httpx.post(f"{served.url}/update_weights/", params=params, content=chunk.data).is_success
    last = chunks[-1]
    params = {"sync_id": "corrupt", "chunk_index": last.index, "digest": "0" * 32, "version": version + 1}
    response = httpx.post(f"{served.url}/update_weights/", params=params, content=last.data)
    assert response.status_code == 400 and "checksum mismatch" in response.json()["detail"]
    commit = {"sync_id": "corrupt", "version": version + 1, "num_chunks": len(chunks)}
    assert httpx.post(f"{served.url}/update_weights/commit/", json=commit).status_code == 400
    wrong_shape = {**perturbed, "lm_head.weight": torch.zeros(3, 3)}
    with pytest.raises(WeightPushError, match="shape"):
        pusher.push_weights(wrong_shape, version + 1)
    assert client.versions()[0].version == version
    (out,) = client.infer([request(3)], GREEDY)
    assert out.choices[0].token_ids == expected and out.version == version
