"""The tiny-model rollout server under load: 64 concurrent `/infer/` clients, two requests each, with a
full weight sync pushed half-way through. Every request is answered, reports the weight version it
ran on, and its greedy tokens are exactly those of that version's weights (computed locally), so no
request saw half-updated weights; every request sent after the sync returned runs on the new weights."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from stagectl.inference.client import RolloutClient, detection_request, to_generation
from stagectl.models.chat import encode_prompt
from stagectl.models.generate import PromptInputs, SamplingSpec, generate_batch
from stagectl.models.loading import ModelBundle, load_bundle
from stagectl.server.launcher import ServerProcess, start_server_process
from stagectl.weightsync.client import WeightSyncClient
from stagectl.wire.protocol import RequestConfig
from tests.faults.helpers import report
from tests.integration.helpers import ROOT

MODEL = "builtin:tiny-qwen2.5-vl"
TOKEN = "load-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INSTRUCTION = "Find every object."
NUM_CLIENTS = 64
ROUNDS = 2
NUM_PROMPTS = 4
GREEDY = RequestConfig(max_tokens=12, temperature=0.0, return_details=True)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("load_images")
    rng = np.random.default_rng(1)
    paths = []
    for k in range(NUM_PROMPTS):
        path = root / f"img{k}.png"
        Image.fromarray(rng.integers(0, 255, (56 + 28 * k, 84, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def server(images: list[Path]) -> Iterator[ServerProcess]:
    served = start_server_process(
        [
            "--model", MODEL, "--port", "0",
            "--set", f"rollout_server.image_roots=[{images[0].parent}]",
            "--set", "rollout_server.max_batch_size=8",
            "--set", "rollout_server.batch_wait_ms=20",
            "--set", "rollout_server.auth_token_env=STAGECTL_TEST_ROLLOUT_TOKEN",
        ],
        env={"STAGECTL_TEST_ROLLOUT_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        timeout_s=300,
    )  # fmt: skip
    yield served
    served.stop()


def _greedy(bundle: ModelBundle, image: Path) -> list[int]:
    p = encode_prompt(
        bundle.tokenizer, bundle.image_processor, [Image.open(image).convert("RGB")], INSTRUCTION
    )
    (generation,) = generate_batch(
        bundle.model,
        [PromptInputs(p.input_ids, p.mm_token_type_ids, p.pixel_values, p.image_grid_thw)],
        SamplingSpec(max_new_tokens=GREEDY.max_tokens, temperature=0.0),
        stop_token_ids=[bundle.end_of_turn_id, int(bundle.tokenizer.pad_token_id)],
        pad_token_id=int(bundle.tokenizer.pad_token_id),
    )
    return generation.token_ids


def test_64_clients_and_a_sync_get_consistent_weights(server: ServerProcess, images: list[Path]) -> None:
    assert server.url is not None
    mirror = load_bundle(MODEL)
    base_version = httpx.get(f"{server.url}/version/", headers=AUTH).json()["version"]
    expected = {base_version: [_greedy(mirror, image) for image in images]}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in mirror.model.named_parameters():
            if name.endswith("lm_head.weight") or "embed_tokens" in name:
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.5)
    new_version = base_version + 1
    expected[new_version] = [_greedy(mirror, image) for image in images]
    assert expected[new_version] != expected[base_version]  # the two versions are told apart by their tokens
    stats_before = httpx.get(f"{server.url}/stats/", headers=AUTH).json()

    results: list[tuple[int, int, float, int | None, list[int]]] = []  # client, prompt, sent_at, ver, ids
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(NUM_CLIENTS + 1)

    def client(k: int) -> None:
        try:
            with RolloutClient([server.url or ""], auth_token=TOKEN) as c:
                start.wait()
                for r in range(ROUNDS):
                    prompt = (k + r) % NUM_PROMPTS
                    sent_at = time.monotonic()
                    (out,) = c.infer([detection_request([images[prompt]], INSTRUCTION)], GREEDY)
                    with lock:
                        results.append((k, prompt, sent_at, out.version, to_generation(out).token_ids))
                assert c.counters()["retries"] == 0
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    start.wait()
    started = time.monotonic()
    while len(results) < NUM_CLIENTS // 4:  # a quarter answered: push while the rest are queued/in flight
        assert time.monotonic() - started < 120 and not errors, errors
        time.sleep(0.01)
    state = {name: t.detach().clone() for name, t in mirror.model.state_dict().items()}
    with WeightSyncClient([server.url], auth_token=TOKEN, chunk_bytes=1 << 20) as pusher:
        push_started = time.monotonic()
        report_ = pusher.push_weights(state, new_version)
        synced_at = time.monotonic()
    for t in threads:
        t.join(timeout=180)
    elapsed = time.monotonic() - started

    assert not errors, errors
    assert len(results) == NUM_CLIENTS * ROUNDS  # every request answered
    for k, prompt, sent_at, version, ids in results:
        assert version in expected, (k, version)
        assert ids == expected[version][prompt], (k, prompt, version)  # exactly that version's weights
        if sent_at > synced_at:
            assert version == new_version, (k, prompt)
    versions = [v for *_, v, _ in results]
    assert versions.count(base_version) > 0 and versions.count(new_version) > 0
    stats = httpx.get(f"{server.url}/stats/", headers=AUTH).json()
    assert stats["num_requests"] - stats_before["num_requests"] == NUM_CLIENTS * ROUNDS
    assert stats["num_syncs"] == stats_before["num_syncs"] + 1 and stats["version"] == new_version
    assert report_.num_chunks > 1
    report(
        fault=f"{NUM_CLIENTS} concurrent clients x {ROUNDS} requests + a full weight sync",
        survived=True,
        requests=len(results),
        answered_on_old=versions.count(base_version),
        answered_on_new=versions.count(new_version),
        sync_s_under_load=round(synced_at - push_started, 2),
        total_s=round(elapsed, 2),
        data_lost=0,
    )
