"""The rollout server's access guards on a real app (uvicorn on 127.0.0.1 in a thread, the fake engine):
the bearer token on every endpoint but `/health/`, `open_infer`, the per-call bounds on `/infer/`, and TLS
on both ports with a self-signed certificate made here (openssl CLI)."""

from __future__ import annotations

import socket
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from stagectl.engines.fake import FakeEngine, default_weights
from stagectl.inference.client import RolloutClient, RolloutRequestError
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.weightsync import stream
from stagectl.weightsync.client import WeightSyncClient
from stagectl.wire.guards import CallLimits
from stagectl.wire.protocol import InferRequest, Message, RequestConfig

TOKEN = "access-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFER = {
    "infer_requests": [{"messages": [{"role": "user", "content": "hi"}]}],
    "request_config": {"max_tokens": 16},
}
MAX_MODEL_LEN = 64  # the fake engine's context: prompt bytes + max_tokens
LIMITS = CallLimits(max_new_tokens_cap=48, max_requests_per_call=4)
PROTECTED = [("GET", "/version/", None), ("GET", "/stats/", None), ("GET", "/get_world_size/", None)]
PROTECTED.append(("POST", "/infer/", INFER))
OPENSSL_SELF_SIGNED = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
OPENSSL_SELF_SIGNED += ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]


def _serve(settings: ServerSettings) -> ThreadedServer:
    engine = FakeEngine(default_weights(), batch_wait_ms=0, max_model_len=MAX_MODEL_LEN)
    return ThreadedServer(build_app(RolloutService(engine, settings))).start()


@pytest.fixture(scope="module")
def guarded() -> Iterator[str]:
    server = _serve(ServerSettings(auth_token=TOKEN, limits=LIMITS))
    yield server.url
    server.stop()


def _call(url: str, method: str, path: str, body: dict | None, headers: dict[str, str]) -> httpx.Response:
    return httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
def test_every_endpoint_but_health_needs_the_token(
    guarded: str, method: str, path: str, body: dict | None
) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        response = _call(guarded, method, path, body, headers)
        assert response.status_code == 401, (path, headers)
        assert response.headers["WWW-Authenticate"] == "Bearer"
    assert _call(guarded, method, path, body, AUTH).status_code == 200
    assert httpx.get(f"{guarded}/health/").status_code == 200  # what load balancers and clients poll


def test_open_infer_opens_the_swift_contract_only() -> None:
    server = _serve(ServerSettings(auth_token=TOKEN, open_infer=True))
    try:
        for method, path, body in PROTECTED:
            expected = 200 if path in ("/infer/", "/get_world_size/") else 401
            assert _call(server.url, method, path, body, {}).status_code == expected, path
        push = RolloutClient([server.url])  # no token: weights stay closed
        with push, pytest.raises(RolloutRequestError, match="HTTP 401"):
            push.versions()
    finally:
        server.stop()


def _text(i: int) -> InferRequest:
    return InferRequest(messages=[Message(role="user", content=f"hello {i}")])


def test_max_tokens_above_the_cap_is_400(guarded: str) -> None:
    with RolloutClient([guarded], auth_token=TOKEN) as client:
        assert len(client.infer([_text(0)], RequestConfig(max_tokens=LIMITS.max_new_tokens_cap))) == 1
        with pytest.raises(
            RolloutRequestError, match=r"HTTP 400: .*max_tokens 10000000 exceeds .* cap of 48"
        ):
            client.infer([_text(0)], RequestConfig(max_tokens=10_000_000))
        assert client.counters()["retries"] == 0  # a refusal, not a failure worth a retry


def test_prompt_plus_max_tokens_beyond_the_context_is_400_naming_both(guarded: str) -> None:
    # the fake engine's prompt is its rendered text in bytes: "user: hello 0" plus framing, ~20 bytes
    body = {**INFER, "request_config": {"max_tokens": 48}}
    response = httpx.post(f"{guarded}/infer/", json=body, headers=AUTH)
    assert response.status_code == 200  # 48 fits next to a short prompt
    long = {
        "infer_requests": [{"messages": [{"role": "user", "content": "x" * 40}]}],
        "request_config": {"max_tokens": 48},
    }
    response = httpx.post(f"{guarded}/infer/", json=long, headers=AUTH)
    assert response.status_code == 400
    detail = response.json()["detail"]
    assert "max_tokens 48" in detail and f"max_model_len of {MAX_MODEL_LEN}" in detail
    assert "a prompt of " in detail  # the prompt's own token count is named


def test_more_requests_than_the_limit_is_413(guarded: str) -> None:
    body = {**INFER, "infer_requests": INFER["infer_requests"] * 4}
    assert httpx.post(f"{guarded}/infer/", json=body, headers=AUTH).status_code == 200
    body = {**INFER, "infer_requests": INFER["infer_requests"] * 5}
    response = httpx.post(f"{guarded}/infer/", json=body, headers=AUTH)
    assert response.status_code == 413
    assert "5 requests in one call" in response.json()["detail"]
    assert "rollout_server.max_requests_per_call" in response.json()["detail"]


# --- TLS --------------------------------------------------------------------------------------------


@dataclass
class Tls:
    url: str
    engine: FakeEngine
    cert: Path


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tls]:
    base = tmp_path_factory.mktemp("tls")
    cert, key = base / "cert.pem", base / "key.pem"
    subprocess.run(
        [*OPENSSL_SELF_SIGNED, "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    engine = FakeEngine(default_weights(num_mib=1, block_mib=1), batch_wait_ms=0)
    settings = ServerSettings(auth_token=TOKEN, tls_certfile=cert, tls_keyfile=key)
    server = ThreadedServer(build_app(RolloutService(engine, settings))).start()
    yield Tls(server.url, engine, cert)
    server.stop()


def test_tls_on_both_ports_with_a_verified_certificate(tls: Tls) -> None:
    assert tls.url.startswith("https://127.0.0.1:")
    weights = {name: torch.full(spec.shape, 2.0) for name, spec in tls.engine.weight_specs().items()}
    with (
        RolloutClient([tls.url], auth_token=TOKEN, tls_ca_file=tls.cert) as client,
        WeightSyncClient([tls.url], auth_token=TOKEN, tls_ca_file=tls.cert, chunk_bytes=256 << 10) as pusher,
    ):
        (out,) = client.infer([_text(0)], RequestConfig(seed=3, max_tokens=64))
        assert out.choices[0].message.content.startswith("echo hello 0 seed=3")
        stream_port = client.versions()[0].weight_stream_port
        report = pusher.push_weights(weights, 1)  # chunks over the weight-stream port, TLS too
        assert report.num_chunks > 1 and client.versions()[0].version == 1
    assert stream_port is not None
    # the weight-stream port speaks TLS with the same certificate, and nothing else
    context = ssl.create_default_context(cafile=str(tls.cert))
    with (
        socket.create_connection(("127.0.0.1", stream_port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as wrapped,
    ):
        assert wrapped.version() is not None
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS stream port: closed, never a weight
        httpx.post(f"http://127.0.0.1:{stream_port}/update_weights/", content=b"x", headers=AUTH, timeout=10)
    assert tls.engine.version == 1


def test_tls_clients_verify_unless_told_not_to(tls: Tls) -> None:
    with (
        RolloutClient([tls.url], auth_token=TOKEN) as unverified,  # the system's CAs: not ours
        pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"),
    ):
        unverified.versions()
    with RolloutClient([tls.url], auth_token=TOKEN, tls_skip_verify=True) as skipping:
        assert skipping.versions()[0].engine == "fake"
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the https port
        httpx.get(tls.url.replace("https://", "http://") + "/health/", timeout=10)
    with pytest.raises(ValueError, match="exclude each other"):
        RolloutClient([tls.url], tls_ca_file=tls.cert, tls_skip_verify=True)


def test_a_stalled_tls_handshake_on_the_stream_port_is_closed_and_blocks_no_one(
    tls: Tls, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream, "READ_TIMEOUT_S", 0.5)
    with WeightSyncClient([tls.url], auth_token=TOKEN, tls_ca_file=tls.cert) as client:
        stream_port = client.versions()[0].weight_stream_port
        assert stream_port is not None
        with socket.create_connection(("127.0.0.1", stream_port), timeout=10) as stalled:
            # a push goes through while the stalled connection waits in its own thread
            weights = {name: torch.full(spec.shape, 3.0) for name, spec in tls.engine.weight_specs().items()}
            version = tls.engine.version + 1
            client.push_weights(weights, version)
            assert tls.engine.version == version
            stalled.settimeout(5)
            assert stalled.recv(1) == b""  # closed by the server after the handshake timeout
