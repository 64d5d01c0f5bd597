"""`stagectl rollout-server --engine vllm` serves text chat models of other families as they are on disk:
tiny Llama 3, Qwen3 and Gemma 3 (no coordinate tokens, real chat templates). Each server, run by the vLLM
CPU environment's interpreter, answers `/infer/` with the prompt the hf engine encodes and the greedy
answer transformers gives, and stops exactly at the family's end-of-turn (planted a few tokens in; see
`tests/integration/any_model.py`). Llama 3's `<|eot_id|>` is not in its generation config: the stop
comes from its chat template."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import httpx
import pytest

from stagectl.models.loading import load_bundle
from stagectl.server.launcher import ServerProcess
from tests.integration.any_model import TEXT_ARCHS, Planted, infer_body, plant_end_of_turn, prompt_of
from tests.vllm.helpers import ROOT, require_vllm_python


@pytest.fixture(params=TEXT_ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def served(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Planted]]:
    python = require_vllm_python()
    path = tmp_path_factory.mktemp(f"planted-{arch}") / "model"
    planted = plant_end_of_turn(arch, path)
    argv = [str(python), "-m", "stagectl", "rollout-server", "--engine", "vllm", "--port", "0"]
    argv += ["--model", str(path)]
    for setting in ("vllm.kv_cache_mb=64", "vllm.max_model_len=512", "max_batch_size=2"):
        argv += ["--set", f"rollout_server.{setting}"]
    server = ServerProcess(argv, env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, cwd=ROOT)
    server.wait_listening(timeout_s=300)
    assert server.url is not None
    yield server.url, planted
    assert server.stop() in (0, -signal.SIGTERM), "\n".join(server.tail)


def test_vllm_serves_the_checkpoint_unchanged_and_stops_at_the_end_of_turn(
    arch: str, served: tuple[str, Planted]
) -> None:
    url, planted = served
    mirror = load_bundle(str(planted.path), add_coord_tokens=False)  # as transformers loads it
    response = httpx.post(f"{url}/infer/", json=infer_body(arch), timeout=300)
    assert response.status_code == 200, response.text
    (item,) = [entry["response"] for entry in response.json()]  # swift's RolloutOutput shape
    choice = item["choices"][0]
    assert item["prompt_token_ids"] == prompt_of(mirror, arch).input_ids  # the hf engine's chat encoding
    # transformers' greedy answer: k ordinary tokens, then the end-of-turn, then nothing.
    assert choice["token_ids"] == planted.expected
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == mirror.tokenizer.decode(planted.expected, skip_special_tokens=True)
