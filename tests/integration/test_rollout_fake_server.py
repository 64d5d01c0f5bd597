"""The real rollout server app (FastAPI + uvicorn on 127.0.0.1, in a thread) over the fake echo engine:
the swift-style contract, bad input, auth, weight sync (http and disk), client retries/splits, batching."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

from stagectl.engines.fake import FakeEngine, default_weights
from stagectl.inference.client import (
    RolloutClient,
    RolloutRequestError,
    RolloutServerError,
    detection_request,
)
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.weightsync.client import WeightSyncClient
from stagectl.weightsync.errors import WeightPushError
from stagectl.weightsync.wire import encode_chunks
from stagectl.wire.protocol import InferRequest, Message, RequestConfig

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KIB = 1024


@dataclass
class Served:
    url: str
    engine: FakeEngine
    root: Path
    outside: Path
    weights_dir: Path


def _serve(engine: FakeEngine, settings: ServerSettings) -> ThreadedServer:
    return ThreadedServer(build_app(RolloutService(engine, settings))).start()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("fake_server")
    root, outside, weights_dir = base / "images", base / "outside", base / "weights"
    for d in (root, outside, weights_dir):
        d.mkdir()
    Image.new("RGB", (8, 6)).save(root / "a.png")
    Image.new("RGB", (4, 4)).save(outside / "secret.png")
    (root / "link.png").symlink_to(outside / "secret.png")
    engine = FakeEngine(
        default_weights(num_mib=1, block_mib=1), max_batch_size=8, batch_wait_ms=20, step_delay_ms=20
    )
    settings = ServerSettings(
        image_roots=[root],
        weight_dirs=[weights_dir],
        auth_token=TOKEN,
        max_request_bytes=64 * KIB,
        max_weight_chunk_bytes=256 * KIB,
    )
    server = _serve(engine, settings)
    yield Served(server.url, engine, root, outside, weights_dir)
    server.stop()


@pytest.fixture
def client(served: Served) -> Iterator[RolloutClient]:
    with RolloutClient([served.url], auth_token=TOKEN) as c:
        yield c


@pytest.fixture
def pusher(served: Served) -> Iterator[WeightSyncClient]:
    with WeightSyncClient([served.url], auth_token=TOKEN, chunk_bytes=128 * KIB) as p:
        yield p


def _text(i: int) -> InferRequest:
    return InferRequest(messages=[Message(role="user", content=f"hello {i}")])


def _contents(responses: list) -> list[str]:
    return [r.choices[0].message.content for r in responses]


def _weights(served: Served, w0: float) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for name, spec in served.engine.weight_specs().items():
        state[name] = torch.full(spec.shape, w0 if name == "w0" else 0.5)
    return state


def test_health_world_size_version(served: Served) -> None:
    assert httpx.get(f"{served.url}/health/").status_code == 200
    # vLLM's `/health` (and a load balancer's probe) got a 307 with an empty body, which `curl` prints as nothing
    assert httpx.get(f"{served.url}/health").json() == httpx.get(f"{served.url}/health/").json()
    assert httpx.get(f"{served.url}/get_world_size/", headers=AUTH).json() == {"world_size": 1}
    version = httpx.get(f"{served.url}/version/", headers=AUTH).json()
    assert version["model"] == "fake-echo" and version["engine"] == "fake" and version["version"] >= 0
    assert version["batch_size"] == 8  # the engine's max_batch_size: the prefetcher sizes requests by it


def test_infer_in_order_with_per_request_seeds(served: Served, client: RolloutClient) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (5, 7)).save(buffer, format="PNG")
    inline = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    requests = [
        detection_request([served.root / "a.png"], "find 0"),
        InferRequest(messages=[Message(role="user", content="<image>find 1")], images=[inline]),
        _text(2),
    ]
    out = client.infer(requests, RequestConfig(seed=40, max_tokens=200, return_details=True))
    contents = _contents(out)
    assert [c.split(" seed=")[0] for c in contents] == ["echo find 0", "echo find 1", "echo hello 2"]
    assert [c.split(" seed=")[1].split()[0] for c in contents] == ["40", "41", "42"]  # base seed + index
    prompt = bytes(out[0].prompt_token_ids or []).decode()
    assert "<image 8x6>find 0" in prompt  # the image was read from the root
    assert "<image 5x7>" in bytes(out[1].prompt_token_ids or []).decode()
    assert bytes(out[2].choices[0].token_ids or []).decode() == contents[2]
    assert out[0].usage.prompt_tokens == len(out[0].prompt_token_ids or [])


def test_max_tokens_and_stop_strings(client: RolloutClient) -> None:
    (short,) = client.infer([_text(0)], RequestConfig(max_tokens=4, return_details=True))
    assert short.choices[0].message.content == "echo" and short.choices[0].finish_reason == "length"
    (stopped,) = client.infer([_text(0)], RequestConfig(stop=[" seed"], return_details=True))
    assert stopped.choices[0].message.content == "echo hello 0"
    assert stopped.choices[0].finish_reason == "stop"
    assert bytes(stopped.choices[0].token_ids or []).decode() == "echo hello 0 seed"


def test_details_are_optional(client: RolloutClient) -> None:
    (out,) = client.infer([_text(0)], RequestConfig())
    assert out.prompt_token_ids is None and out.choices[0].token_ids is None


def test_empty_request_list(served: Served, client: RolloutClient) -> None:
    response = httpx.post(f"{served.url}/infer/", headers=AUTH, json={"infer_requests": []})
    assert response.status_code == 200 and response.json() == []
    assert client.infer([], RequestConfig()) == []


def test_body_above_limit_is_413(served: Served) -> None:
    big = {"infer_requests": [{"messages": [{"role": "user", "content": "x" * (80 * KIB)}]}]}
    response = httpx.post(f"{served.url}/infer/", headers=AUTH, json=big)
    assert response.status_code == 413
    assert "exceeds" in response.json()["detail"]


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("outside/secret.png", "resolves outside rollout_server.image_roots"),
        ("images/link.png", "resolves outside rollout_server.image_roots"),
        ("images/../outside/secret.png", "'..' is not allowed"),
        ("https://example.com/a.png", "URLs are not fetched"),
    ],
)
def test_images_outside_roots_are_400(served: Served, path: str, error: str) -> None:
    ref = path if path.startswith("https") else str(served.root.parent / path)
    body = {"infer_requests": [{"messages": [{"role": "user", "content": "<image>x"}], "images": [ref]}]}
    response = httpx.post(f"{served.url}/infer/", headers=AUTH, json=body)
    assert response.status_code == 400
    assert error in response.json()["detail"]
    assert "infer_requests[0]" in response.json()["detail"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"infer_requests": [{"images": []}]}, "infer_requests.0.messages: Field required"),
        ({}, "infer_requests: Field required"),
        ({"infer_requests": [], "request_config": {"max_tokens": 0}}, "request_config.max_tokens"),
        (
            {"infer_requests": [], "request_config": {"temprature": 1}},
            "request_config.temprature: Extra inputs",
        ),
    ],
)
def test_missing_or_bad_fields_are_422_naming_them(served: Served, body: dict, field: str) -> None:
    response = httpx.post(f"{served.url}/infer/", headers=AUTH, json=body)
    assert response.status_code == 422
    assert field in response.json()["detail"]


def test_malformed_json_is_422(served: Served) -> None:
    response = httpx.post(
        f"{served.url}/infer/",
        content=b'{"infer_requests": [',
        headers={"Content-Type": "application/json", **AUTH},
    )
    assert response.status_code == 422
    assert response.json()["detail"] == "<body>: invalid JSON at character 20: Expecting value"


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_without_a_json_content_type_is_422_naming_the_header(
    served: Served, content_type: str | None
) -> None:
    """`curl -d` sends form-urlencoded; FastAPI never parses such a body, and used to answer "Input should be
    a valid dictionary" for a body that is valid JSON."""
    headers = dict(AUTH) if content_type is None else {"Content-Type": content_type, **AUTH}
    response = httpx.post(f"{served.url}/infer/", content=b'{"infer_requests": []}', headers=headers)
    assert response.status_code == 422
    assert "send the body as JSON with Content-Type: application/json" in response.json()["detail"]


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}]
)
def test_weight_endpoints_need_the_token(served: Served, headers: dict[str, str]) -> None:
    for path, kwargs in [
        ("/update_weights/?sync_id=x&chunk_index=0&digest=" + "0" * 32 + "&version=99", {"content": b"x"}),
        ("/update_weights/commit/", {"json": {"sync_id": "x", "version": 99, "num_chunks": 1}}),
        ("/update_weights/abort/", {"json": {"sync_id": "x"}}),
        ("/update_weights/from_disk/", {"json": {"path": "/tmp/x.safetensors", "version": 99}}),
    ]:
        response = httpx.post(f"{served.url}{path}", headers=headers, **kwargs)
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"] == "Bearer"


def _version(served: Served) -> int:
    return int(httpx.get(f"{served.url}/version/", headers=AUTH).json()["version"])


def test_http_push_swaps_weights_and_advances_version(
    served: Served, client: RolloutClient, pusher: WeightSyncClient
) -> None:
    before = _version(served)
    report = pusher.push_weights(_weights(served, 0.25), before + 1)
    assert report.num_chunks > 1  # the 1 MiB block was split over 128 KiB chunks
    assert _version(served) == before + 1
    (out,) = client.infer([_text(0)], RequestConfig(max_tokens=200))
    assert f"ver={before + 1} w=4" in out.choices[0].message.content  # 16 x 0.25
    assert out.version == before + 1
    assert torch.equal(served.engine.weights["block0"], torch.full((256, 1024), 0.5))


def test_sync_killed_half_way_keeps_the_old_weights(
    served: Served, client: RolloutClient, pusher: WeightSyncClient
) -> None:
    before = _version(served)
    (old,) = client.infer([_text(0)], RequestConfig(max_tokens=200))
    chunks = list(encode_chunks(_weights(served, 9.0), 128 * KIB))
    assert len(chunks) > 3
    for chunk in chunks[:2]:  # the "learner" dies after two chunks
        params = {
            "sync_id": "dead",
            "chunk_index": chunk.index,
            "digest": chunk.digest,
            "version": before + 1,
        }
        assert httpx.post(
            f"{served.url}/update_weights/", params=params, content=chunk.data, headers=AUTH
        ).is_success
    assert _version(served) == before
    (now,) = client.infer([_text(0)], RequestConfig(max_tokens=200))
    assert now.choices[0].message.content == old.choices[0].message.content
    # committing the partial sync is refused; a new sync supersedes it and works
    commit = {"sync_id": "dead", "version": before + 1, "num_chunks": len(chunks)}
    response = httpx.post(f"{served.url}/update_weights/commit/", json=commit, headers=AUTH)
    assert response.status_code == 400 and "2 arrived" in response.json()["detail"]
    assert _version(served) == before
    pusher.push_weights(_weights(served, 1.0), before + 1)
    assert _version(served) == before + 1


def test_bad_checksum_is_rejected(served: Served) -> None:
    before = _version(served)
    failed = httpx.get(f"{served.url}/stats/", headers=AUTH).json()["num_failed_syncs"]
    (chunk, *_rest) = encode_chunks(_weights(served, 5.0), 128 * KIB)
    params = {"sync_id": "bad", "chunk_index": 0, "digest": "a" * 32, "version": before + 1}
    response = httpx.post(f"{served.url}/update_weights/", params=params, content=chunk.data, headers=AUTH)
    assert response.status_code == 400
    assert (
        "checksum mismatch" in response.json()["detail"]
        and f"still serving version {before}" in response.json()["detail"]
    )
    commit = {"sync_id": "bad", "version": before + 1, "num_chunks": 1}
    response = httpx.post(f"{served.url}/update_weights/commit/", json=commit, headers=AUTH)
    assert response.status_code == 400 and "unknown weight sync" in response.json()["detail"]
    assert _version(served) == before
    assert httpx.get(f"{served.url}/stats/", headers=AUTH).json()["num_failed_syncs"] == failed + 1


def test_mismatched_or_stale_syncs_are_rejected(
    served: Served, client: RolloutClient, pusher: WeightSyncClient
) -> None:
    before = _version(served)
    wrong_shape = {**_weights(served, 1.0), "w0": torch.zeros(3, 3)}
    with pytest.raises(WeightPushError, match=r"w0: shape \[3, 3\], the serving model has \[4, 4\]"):
        pusher.push_weights(wrong_shape, before + 1)
    missing = {"w0": torch.zeros(4, 4)}
    with pytest.raises(WeightPushError, match="incomplete full sync: 1 tensors missing"):
        pusher.push_weights(missing, before + 1)
    with pytest.raises(WeightPushError, match="not above the serving version"):
        pusher.push_weights(_weights(served, 1.0), before)
    assert _version(served) == before


def test_chunk_above_limit_is_413(served: Served) -> None:
    big_chunks = WeightSyncClient([served.url], auth_token=TOKEN, chunk_bytes=4 * 1024 * KIB)
    with big_chunks, pytest.raises(WeightPushError, match="HTTP 413"):
        big_chunks.push_weights(_weights(served, 1.0), _version(served) + 1)


def test_disk_push(served: Served, client: RolloutClient) -> None:
    before = _version(served)
    disk = WeightSyncClient([served.url], auth_token=TOKEN, transport="disk", disk_dir=served.weights_dir)
    with disk:
        report = disk.push_weights(_weights(served, 0.5), before + 1)
    assert report.transport == "disk" and _version(served) == before + 1
    assert list(served.weights_dir.iterdir()) == []  # the snapshot is removed after the commit
    (out,) = client.infer([_text(0)], RequestConfig(max_tokens=200))
    assert "w=8" in out.choices[0].message.content
    outside = served.outside / "w.safetensors"
    body = {"path": str(outside), "version": before + 5}
    response = httpx.post(f"{served.url}/update_weights/from_disk/", json=body, headers=AUTH)
    assert response.status_code == 400 and "resolves outside --weights-dir" in response.json()["detail"]


def test_concurrent_clients_are_batched(served: Served) -> None:
    stats_before = httpx.get(f"{served.url}/stats/", headers=AUTH).json()
    results: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def one_client(k: int) -> None:
        try:
            with RolloutClient([served.url], auth_token=TOKEN) as c:
                requests = [_text(10 * k + j) for j in range(4)]
                results[k] = _contents(c.infer(requests, RequestConfig(seed=100 * k, max_tokens=200)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one_client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in range(8):
        assert [c.split(" ver=")[0] for c in results[k]] == [
            f"echo hello {10 * k + j} seed={100 * k + j}" for j in range(4)
        ]
    stats = httpx.get(f"{served.url}/stats/", headers=AUTH).json()
    assert stats["num_requests"] - stats_before["num_requests"] == 32
    new_batches = {
        int(size): count - stats_before["batch_sizes"].get(size, 0)
        for size, count in stats["batch_sizes"].items()
    }
    assert max(size for size, count in new_batches.items() if count > 0) > 4  # several clients per batch
    assert max(new_batches) <= 8


def test_client_retries_then_splits(served: Served, client: RolloutClient) -> None:
    requests = [_text(j) for j in range(4)]
    served.engine.fail_next_batches = 1
    out = client.infer(requests, RequestConfig(seed=7, max_tokens=200))
    assert client.counters()["retries"] == 1 and client.counters()["splits"] == 0
    assert [c.split(" ver=")[0] for c in _contents(out)] == [f"echo hello {j} seed={7 + j}" for j in range(4)]
    served.engine.fail_next_batches = 2  # the call and its retry fail: split into [0, 2) and [2, 4)
    out = client.infer(requests, RequestConfig(seed=7, max_tokens=200))
    assert client.counters()["retries"] == 2 and client.counters()["splits"] == 1
    assert [c.split(" ver=")[0] for c in _contents(out)] == [f"echo hello {j} seed={7 + j}" for j in range(4)]
    served.engine.fail_next_batches = 2
    with pytest.raises(RolloutServerError, match=r"requests \[0, 1\) seed=7 failed twice"):
        client.infer(requests[:1], RequestConfig(seed=7))
    assert client.counters()["failed_calls"] == 1


def test_client_does_not_retry_refusals(served: Served, client: RolloutClient) -> None:
    bad = InferRequest(
        messages=[Message(role="user", content="<image>x")], images=[str(served.outside / "secret.png")]
    )
    with pytest.raises(RolloutRequestError, match="HTTP 400"):
        client.infer([bad], RequestConfig())
    assert client.counters()["retries"] == 0


def test_requests_spread_over_servers_in_order(served: Served) -> None:
    second = FakeEngine(max_batch_size=8, batch_wait_ms=0)
    server = _serve(second, ServerSettings())
    try:
        with RolloutClient([served.url, server.url], auth_token=TOKEN) as c:
            out = c.infer([_text(j) for j in range(5)], RequestConfig(seed=0, max_tokens=200))
            stats = c.stats()
    finally:
        server.stop()
    assert [c.split(" ver=")[0] for c in _contents(out)] == [f"echo hello {j} seed={j}" for j in range(5)]
    assert stats[1]["num_requests"] == 2  # the second server got the last contiguous part
    assert [r.choices[0].message.content.endswith("w=0") for r in out][3:] == [True, True]


def test_infer_timeout(served: Served) -> None:
    slow = FakeEngine(batch_wait_ms=0, step_delay_ms=400)
    server = _serve(slow, ServerSettings())
    try:
        with RolloutClient([server.url], infer_timeout_s=0.1) as impatient:
            # the read timeout and the whole-call deadline are both 0.1 s here: either may fire first, and
            # both name the time and its key
            with pytest.raises(RolloutServerError, match=r"within 0\.1 s \(infer_timeout_s sets it\)"):
                impatient.infer([_text(0)], RequestConfig())
            assert impatient.counters()["retries"] == 1
        with RolloutClient([server.url], infer_timeout_s=0) as patient:  # <= 0: no read timeout
            assert len(patient.infer([_text(0)], RequestConfig())) == 1
    finally:
        server.stop()


def test_wait_healthy_times_out_naming_the_server() -> None:
    with RolloutClient(["http://127.0.0.1:9"]) as c, pytest.raises(TimeoutError, match=r"127\.0\.0\.1:9"):
        c.wait_healthy(timeout_s=0.3)


def test_servers_left_on_different_versions_give_no_rollout_until_the_next_sync() -> None:
    """A multi-server sync that committed on one server only (its commit failed on the other) leaves the
    servers on different weights: a section of the learner's version refuses their answers (no mixed
    batch is ever trained), and the next sync, past the highest served version, puts every server on one
    version again."""
    from types import SimpleNamespace

    from stagectl.config.sampling import SamplingSpec
    from stagectl.learner.channel_b.clock import VersionClock
    from stagectl.learner.channel_b.rollouts import ServerRollouts

    engines = [FakeEngine(default_weights(), batch_wait_ms=0) for _ in range(2)]
    servers = [_serve(e, ServerSettings()) for e in engines]
    encoder = SimpleNamespace(samples=[SimpleNamespace(images=[]) for _ in range(8)])
    clock = VersionClock()
    try:
        with (
            RolloutClient([s.url for s in servers]) as both,
            WeightSyncClient([s.url for s in servers]) as both_push,
            WeightSyncClient([servers[0].url]) as first,
        ):
            source = ServerRollouts(
                both,
                encoder,
                SamplingSpec(max_new_tokens=8),
                2,
                clock,
            )
            assert len(source.rollout(list(range(4)), seed=0)) == 4
            weights = {name: t + 1 for name, t in default_weights().items()}
            first.push_weights(weights, 1)  # the commit that landed on server 0 only
            with pytest.raises(
                RolloutServerError, match=r"weight versions \[0, 1\] inside a section of version 0"
            ):
                source.rollout(list(range(4)), seed=0)
            # the next sync goes past the highest version any server serves (`WeightPublisher`): a second
            # version 1 would be refused by server 0 as not newer
            with pytest.raises(WeightPushError, match="not above the serving version 1"):
                both_push.push_weights(weights, 1)
            both_push.push_weights(weights, 2)
            clock.advance(2)
            assert len(source.rollout(list(range(4)), seed=0)) == 4
    finally:
        for server in servers:
            server.stop()


def test_a_sync_during_a_call_is_swapped_in_after_it_without_waiting_for_it() -> None:
    """A push that commits while a call of two batches is in progress returns before the call ends
    (`deferred`); the call, and a call tagged with the old version sent meanwhile, are answered at the old
    version from first to last rollout; then untagged calls get the new one, and a call tagged with the
    old one is refused with 409 (`WrongVersionError`)."""
    from stagectl.wire.errors import WrongVersionError

    slow = FakeEngine(default_weights(), max_batch_size=2, batch_wait_ms=0, step_delay_ms=300)
    server = _serve(slow, ServerSettings())
    answers: dict[str, list] = {}

    def call(name: str, tag: int | None) -> None:
        with RolloutClient([server.url]) as c:
            answers[name] = c.infer([_text(i) for i in range(4)], RequestConfig(), weight_version=tag)

    try:
        with WeightSyncClient([server.url]) as pusher, RolloutClient([server.url]) as client:
            assert httpx.get(f"{server.url}/version/").json()["version_tags"] is True
            long_call = threading.Thread(target=call, args=("long", None))
            long_call.start()
            time.sleep(0.1)  # the first of its two batches decodes
            pusher.push_weights({name: t + 1 for name, t in default_weights().items()}, 1)
            assert long_call.is_alive()  # the push did not wait for the call in progress
            assert httpx.get(f"{server.url}/version/").json()["version"] == 1  # committed
            tagged = threading.Thread(target=call, args=("tagged", 0))
            tagged.start()
            long_call.join(10.0)
            tagged.join(10.0)
            for name in ("long", "tagged"):
                assert {r.version for r in answers[name]} == {0}, name
                assert all(c.endswith("w=0") for c in _contents(answers[name])), name
            (out,) = client.infer([_text(0)], RequestConfig())
            assert out.version == 1 and _contents([out])[0].endswith("w=16")
            with pytest.raises(WrongVersionError, match=r"409.*weight_version 0 is no longer served"):
                client.infer([_text(0)], RequestConfig(), weight_version=0)
            stats = httpx.get(f"{server.url}/stats/").json()
            assert stats["num_deferred_syncs"] == 1 and stats["num_syncs"] == 1
    finally:
        server.stop()
