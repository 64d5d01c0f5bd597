"""The `/infer/` contract against the real ms-swift package (pinned in `.venv-interop`): swift's own client
code path (its dataclasses -> `asdict` -> stagectl's server -> its parser), every swift request field
honoured (its effect shown) or refused by name (a 400), and stagectl's client reading servers that answer
with swift's own models. stagectl's server runs here in-process over the fake engine; swift runs in
subprocesses of its environment (`swift_side.py`)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from stagectl.config import load_config
from stagectl.config.plan_server import server_plan
from stagectl.engines.fake import FakeEngine, fake_logprob
from stagectl.engines.hf import HFEngine
from stagectl.engines.interface import EngineRequest, EngineResult
from stagectl.inference.client import RolloutClient, RolloutRequestError, to_generation
from stagectl.models.chat import encode_prompt
from stagectl.models.generate import PromptInputs, SamplingSpec, generate_batch
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer, build_engine
from stagectl.wire.protocol import InferRequest, Message, RequestConfig
from tests.interop.helpers import SWIFT_SIDE, require_interop_python, swift_client

INSTRUCTION = "Find every object."


class RecordingEngine(FakeEngine):
    """The fake engine, keeping every request it generated for (what the server made of the wire fields)."""

    def __init__(self) -> None:
        super().__init__(max_batch_size=8, batch_wait_ms=5)
        self.seen: list[EngineRequest] = []

    def generate(self, requests: Any) -> list[EngineResult]:
        self.seen += list(requests)
        return super().generate(requests)

    def seen_for(self, text: str) -> list[EngineRequest]:
        return [r for r in self.seen if r.messages[-1]["content"] == text]


def _msg(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


# Each case goes through swift's client in one subprocess (swift's import takes seconds): name -> case.
HONOURED: dict[str, dict[str, Any]] = {
    "greedy": {
        "requests": [_msg("hello 0"), _msg("hello 1")],
        "request_config": {"temperature": 0, "max_tokens": 200, "seed": 7, "return_details": True},
    },
    "all_defaults": {"requests": [_msg("defaults")], "request_config": {}},
    "max_tokens": {"requests": [_msg("short")], "request_config": {"max_tokens": 5, "return_details": True}},
    "stop": {"requests": [_msg("stopper")], "request_config": {"stop": [" seed"], "seed": 1}},
    "seed": {"requests": [_msg("s0"), _msg("s1")], "request_config": {"seed": 40}},
    "uuid": {"requests": [{**_msg("named"), "uuid": "req-abc"}], "request_config": {}},
    "sampling": {
        "requests": [_msg("sampling")],
        "request_config": {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1},
    },
    "logprobs": {
        "requests": [_msg("logprobs")],
        "request_config": {"logprobs": True, "return_details": True},
    },
    # swift's defaults for what stagectl does not implement are accepted (and are what it does anyway)
    "unimplemented_at_defaults": {
        "requests": [{**_msg("at-defaults"), "tools": [], "add_eos": None}],
        "request_config": {"n": 1, "best_of": 1, "num_beams": 1, "min_p": 0.0, "top_logprobs": 0},
    },
}
REFUSED: dict[str, tuple[str, dict[str, Any]]] = {  # field named in the 400 -> (where, value)
    "request_config.n": ("config", {"n": 2}),
    "request_config.best_of": ("config", {"best_of": 2}),
    "request_config.num_beams": ("config", {"num_beams": 2}),
    "request_config.length_penalty": ("config", {"length_penalty": 0.5}),
    "request_config.stream": ("config", {"stream": True}),
    "request_config.min_p": ("config", {"min_p": 0.1}),
    "request_config.presence_penalty": ("config", {"presence_penalty": 0.5}),
    "request_config.frequency_penalty": ("config", {"frequency_penalty": 0.5}),
    "request_config.top_logprobs": ("config", {"top_logprobs": 2}),
    "request_config.prompt_logprobs": ("config", {"prompt_logprobs": 1}),
    "request_config.structured_outputs_regex": ("config", {"structured_outputs_regex": "a+"}),
    "infer_requests[0].audios": ("request", {"audios": ["a.wav"]}),
    "infer_requests[0].videos": ("request", {"videos": ["v.mp4"]}),
    "infer_requests[0].tools": ("request", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    "infer_requests[0].objects": ("request", {"objects": {"bbox": [[1, 2, 3, 4]]}}),
    "infer_requests[0].chat_template_kwargs": (
        "request",
        {"chat_template_kwargs": {"enable_thinking": False}},
    ),
    "infer_requests[0].data_dict": ("request", {"data_dict": {"solution": "x"}}),
    "infer_requests[0].add_eos": ("request", {"add_eos": True}),
}


def _refused_case(where: str, value: dict[str, Any]) -> dict[str, Any]:
    if where == "config":
        return {"requests": [_msg("refused")], "request_config": value}
    return {"requests": [{**_msg("refused"), **value}], "request_config": {}}


@pytest.fixture(scope="module")
def swift_python() -> Path:
    return require_interop_python()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RecordingEngine]]:
    engine = RecordingEngine()
    root = tmp_path_factory.mktemp("interop_images")
    server = ThreadedServer(build_app(RolloutService(engine, ServerSettings(image_roots=[root])))).start()
    yield server.url, engine
    server.stop()


@pytest.fixture(scope="module")
def swift_results(swift_python: Path, served: tuple[str, RecordingEngine]) -> dict[str, dict[str, Any]]:
    """Every case above, sent once through swift's client: case name (or refused field) -> result."""
    names = list(HONOURED) + list(REFUSED)
    cases = list(HONOURED.values()) + [_refused_case(*REFUSED[name]) for name in REFUSED]
    return dict(zip(names, swift_client(swift_python, served[0], cases), strict=True))


def _items(swift_results: dict[str, dict[str, Any]], name: str) -> list[dict[str, Any]]:
    result = swift_results[name]
    assert "error" not in result, result
    return list(result["items"])


def test_swift_client_round_trips_greedy_token_ids(
    swift_results: dict[str, dict[str, Any]], served: tuple[str, RecordingEngine]
) -> None:
    items = _items(swift_results, "greedy")
    # swift parsed our answer as its RolloutOutput (its first choice), with our extras where it keeps them
    assert [item["type"] for item in items] == ["RolloutOutput", "RolloutOutput"]
    requests = [InferRequest(messages=[Message(role="user", content=f"hello {i}")]) for i in range(2)]
    config = RequestConfig(temperature=0, max_tokens=200, seed=7, return_details=True)
    with RolloutClient([served[0]]) as client:
        ours = client.infer(requests, config)
    for item, mine in zip(items, ours, strict=True):
        assert item["token_ids"] and item["token_ids"] == mine.choices[0].token_ids
        assert item["prompt_token_ids"] == mine.prompt_token_ids
        assert item["response_token_ids"] == [item["token_ids"]]
        assert item["rollout_infos"] == {"weight_version": mine.version} and mine.version == 0
        assert item["content"] == mine.choices[0].message.content


def test_swift_defaults_are_accepted_and_mean_our_defaults(
    swift_results: dict[str, dict[str, Any]], served: tuple[str, RecordingEngine]
) -> None:
    (item,) = _items(swift_results, "all_defaults")
    assert item["token_ids"] is None and item["prompt_token_ids"] is None  # return_details false
    (seen,) = served[1].seen_for("defaults")
    default = RequestConfig().sampling()
    assert seen.params == default and seen.seed is None  # swift's nulls became our defaults
    (item,) = _items(swift_results, "unimplemented_at_defaults")
    assert item["content"].startswith("echo at-defaults")


def test_swift_sampling_fields_are_honoured(
    swift_results: dict[str, dict[str, Any]], served: tuple[str, RecordingEngine]
) -> None:
    (short,) = _items(swift_results, "max_tokens")
    assert (
        short["completion_tokens"] == 5
        and len(short["token_ids"]) == 5
        and short["finish_reason"] == "length"
    )
    (stopped,) = _items(swift_results, "stop")
    assert stopped["content"] == "echo stopper" and stopped["finish_reason"] == "stop"
    s0, s1 = _items(swift_results, "seed")
    assert "seed=40 " in s0["content"] and "seed=41 " in s1["content"]  # request i samples with seed + i
    (named,) = _items(swift_results, "uuid")
    assert named["id"] == "req-abc"
    (scored,) = _items(swift_results, "logprobs")
    content = scored["logprobs"]["content"]  # swift's own ChatCompletionResponseChoice.logprobs
    assert len(content) == len(scored["token_ids"]) > 0
    assert [e["logprob"] for e in content] == [fake_logprob(t) for t in scored["token_ids"]]
    assert scored["rollout_logprobs"] == [[e["logprob"] for e in content]]
    (seen,) = served[1].seen_for("sampling")
    params = seen.params
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.5, 0.9, 5, 1.1)


@pytest.mark.parametrize("field", list(REFUSED))
def test_swift_fields_we_cannot_honour_are_refused_by_name(
    swift_results: dict[str, dict[str, Any]], field: str
) -> None:
    error = swift_results[field].get("error", "")
    assert "failed: 400" in error and f"{field}=" in error and "cannot be honoured" in error


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"use_tqdm": True}, "use_tqdm"),
        ({"metrics": [{"name": "acc"}]}, "metrics"),
        ({"adapter_request": {"name": "lora", "path": "/x"}}, "adapter_request"),
    ],
)
def test_top_level_swift_fields_refused_by_name(
    served: tuple[str, RecordingEngine], extra: dict[str, Any], field: str
) -> None:
    # swift's client cannot send these non-null itself (its Metric and AdapterRequest objects are not JSON)
    body = {"infer_requests": [_msg("x")], "request_config": None, **extra}
    response = httpx.post(f"{served[0]}/infer/", json=body)
    assert response.status_code == 400 and f"{field}=" in response.json()["detail"]
    accepted = httpx.post(f"{served[0]}/infer/", json={**body, field: None})
    assert accepted.status_code == 200


@pytest.mark.parametrize("shape", ["rollout", "deploy"])
def test_our_client_reads_a_server_answering_with_swift_models(swift_python: Path, shape: str) -> None:
    server = subprocess.Popen(
        [str(swift_python), str(SWIFT_SIDE), "serve", shape], stdout=subprocess.PIPE, text=True, cwd="/"
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith("listening on "), line
        with RolloutClient([line.split()[-1]]) as client:
            client.wait_healthy(60.0)
            requests = [InferRequest(messages=[Message(role="user", content=f"q{i}")]) for i in range(2)]
            out = client.infer(requests, RequestConfig(temperature=0, return_details=True))
            for i, response in enumerate(out):
                reply = f"swift {i}: q{i}"
                assert response.choices[0].message.content == reply and response.version is None
                assert to_generation(response).token_ids == list(reply.encode())
                assert response.prompt_token_ids == list(f"q{i}".encode())
            # Channel-B cannot run on it: said at start-up (the learner asks every server's version first)
            with pytest.raises(RolloutRequestError, match="not a stagectl rollout server"):
                client.versions()
    finally:
        server.terminate()
        server.wait(30)


def test_answer_shapes_as_swift_parses_them(swift_python: Path, served: tuple[str, RecordingEngine]) -> None:
    """Why the answer is swift's `RolloutOutput` with the version in `rollout_infos` (docs/swift_interop.md):
    the flat shape stagectl answered before is refused by swift's parser, and a flat shape without the
    version is parsed only loosely (its choices stay dicts, so swift's trainer cannot read them)."""
    body = {"infer_requests": [_msg("shape")], "request_config": {"return_details": True}}
    ours = httpx.post(f"{served[0]}/infer/", json=body).json()
    flat = dict(ours[0]["response"])
    before = {**flat, "version": 0}
    done = subprocess.run(
        [str(swift_python), str(SWIFT_SIDE), "parse"],
        input=json.dumps([ours[0], before, flat]),
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    now, old, loose = json.loads(done.stdout)
    assert now == "RolloutOutput"
    assert old.startswith("refused:") and "'version'" in old
    assert loose == "ChatCompletionResponse (choices left as dicts)"


def test_swift_client_greedy_token_ids_from_the_tiny_vl_model(swift_python: Path, tmp_path: Path) -> None:
    """The one run with a real model (the tiny Qwen2.5-VL on the hf engine, an image request): swift's
    client gets the greedy token ids transformers' own greedy decode gives, and the prompt ids."""
    image_path = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(image_path)
    engine = build_engine(server_plan(load_config(None, ["model.name_or_path=builtin:tiny-qwen2.5-vl"])))
    assert isinstance(engine, HFEngine)
    bundle = engine.bundle
    server = ThreadedServer(build_app(RolloutService(engine, ServerSettings(image_roots=[tmp_path])))).start()
    try:
        case = {
            "requests": [{**_msg(f"<image>{INSTRUCTION}"), "images": [str(image_path)]}],
            "request_config": {"temperature": 0, "max_tokens": 12, "return_details": True},
        }
        ((item,),) = [r["items"] for r in swift_client(swift_python, server.url, [case])]
    finally:
        server.stop()
    prompt = encode_prompt(
        bundle.tokenizer, bundle.image_processor, [Image.open(image_path).convert("RGB")], INSTRUCTION
    )
    (local,) = generate_batch(
        bundle.model,
        [
            PromptInputs(
                prompt.input_ids, prompt.mm_token_type_ids, prompt.pixel_values, prompt.image_grid_thw
            )
        ],
        SamplingSpec(max_new_tokens=12, temperature=0.0),
        stop_token_ids=[bundle.end_of_turn_id, int(bundle.tokenizer.pad_token_id)],
        pad_token_id=int(bundle.tokenizer.pad_token_id),
    )
    assert item["type"] == "RolloutOutput" and item["token_ids"] == local.token_ids and local.token_ids
    assert item["prompt_token_ids"] == list(prompt.input_ids)
