"""`stagectl doctor`'s rollout-server checks against the real app with the fake engine on 127.0.0.1: each
probe made to fail (no server, a wrong token, another dtype or version, a closed weight port, a push the
server refuses) and its line read back."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import stagectl
from stagectl.config import load_config
from stagectl.config.plan_server import LearnerServers, learner_servers
from stagectl.doctor import server_checks
from stagectl.doctor.report import Check
from stagectl.doctor.server_checks import _version, _weight_transport, check_push, check_servers
from stagectl.engines.fake import FakeEngine
from stagectl.models.loading import ModelBundle, load_bundle
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from stagectl.wire.protocol import VersionResponse
from tests.helpers import returns_within, trickle_server

TINY = "builtin:tiny-qwen2.5-vl"
TOKEN_ENV = "DOCTOR_TEST_TOKEN"


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_bundle(TINY)


def _serve(tmp_path: Path, weights: dict[str, Any] | None = None) -> ThreadedServer:
    engine = FakeEngine(weights=weights, model_name=TINY, batch_wait_ms=0)
    engine.name = "hf"  # the fake stands in for the configured hf engine
    settings = ServerSettings(auth_token="s3cret")
    return ThreadedServer(build_app(RolloutService(engine, settings))).start()


@pytest.fixture
def server(tmp_path: Path, bundle: ModelBundle, monkeypatch: pytest.MonkeyPatch) -> Iterator[ThreadedServer]:
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    weights = {k: v.detach().clone() for k, v in bundle.model.state_dict().items()}
    running = _serve(tmp_path, weights)
    yield running
    running.stop()


def _servers(tmp_path: Path, url: str, **sections: Any) -> LearnerServers:
    """The learner's servers of a train-ab config talking to `url` (`sections` merged in)."""
    rollouts = {
        "rollout_backend": "vllm",
        "vllm": {"server": {"servers": [{"base_url": url}], "auth_token_env": TOKEN_ENV}},
    }
    raw: dict[str, Any] = {
        "model": {"name_or_path": TINY},
        "data": {"synthetic": {"num_samples": 8}},
        "training": {"output_dir": str(tmp_path / "run")},
        "custom": {"extra": {"rollout_matching": rollouts}},
        "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "step"}},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return learner_servers(load_config(path, world_size=1))


def _by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_a_good_server_passes_every_probe(tmp_path: Path, server: ThreadedServer) -> None:
    checks = _by_name(check_servers(_servers(tmp_path, server.url)))
    assert {name: c.status for name, c in checks.items()} == {
        "server[0].reachable": "ok",
        "server[0].auth": "ok",
        "server[0].version": "ok",
        "server[0].engine": "ok",
        "server[0].weight_transport": "ok",
    }
    assert checks["server[0].auth"].message == "token accepted"
    assert (
        checks["server[0].version"].message
        == f"stagectl {stagectl.__version__}, serving weight version 0 of {TINY}"
    )
    assert checks["server[0].engine"].message == "hf, float32"
    assert checks["server[0].weight_transport"].message.startswith("http: weight-stream port 127.0.0.1:")


def test_no_server_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    (line,) = check_servers(_servers(tmp_path, url))
    assert line.name == "server[0].reachable" and line.status == "fail"
    assert line.message.startswith(f"{url}: ConnectError") and "stagectl rollout-server" in line.fix


@pytest.mark.parametrize("head", [b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"])
def test_a_server_that_trickles_its_answer_fails_within_the_probe_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, head: bytes
) -> None:
    """A server trickling a byte every 0.2 s (its headers, or its body) never trips a 1 s read timeout:
    the probe's whole-call deadline ends it (it hung `stagectl doctor` forever)."""
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    monkeypatch.setattr(server_checks, "PROBE_TIMEOUT_S", 1.0)
    with trickle_server(every_s=0.2, head=head) as url:
        servers = _servers(tmp_path, url)
        (line,), seconds = returns_within(4.0, lambda: check_servers(servers))
    assert line.name == "server[0].reachable" and line.status == "fail", line
    assert "no whole answer within 1 s" in line.message and "stagectl rollout-server" in line.fix
    assert seconds < 3.0


def test_a_wrong_or_missing_token(
    tmp_path: Path, server: ThreadedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "wrong")
    checks = check_servers(_servers(tmp_path, server.url))
    assert [(c.name, c.status) for c in checks] == [("server[0].reachable", "ok"), ("server[0].auth", "fail")]
    assert checks[1].message == f"{server.url} refuses the token (HTTP 401)"
    assert checks[1].fix == f"export the server's token in ${TOKEN_ENV}"
    monkeypatch.delenv(TOKEN_ENV)
    (line,) = check_servers(_servers(tmp_path, server.url))
    assert line.name == "server.token" and line.status == "fail" and f"${TOKEN_ENV}" in line.message


def test_another_sync_dtype_fails(tmp_path: Path, server: ThreadedServer) -> None:
    cfg = _servers(
        tmp_path,
        server.url,
        model={"torch_dtype": "bfloat16"},
        training={"mixed_precision": "bf16", "output_dir": str(tmp_path / "run")},
    )
    engine = _by_name(check_servers(cfg))["server[0].engine"]
    assert engine.status == "fail"
    assert engine.message == "weights in float32, but the learner syncs bfloat16 (model.torch_dtype)"
    cfg = _servers(tmp_path, server.url, rollout_server={"engine": "vllm"})
    engine = _by_name(check_servers(cfg))["server[0].engine"]
    assert (
        engine.status == "fail" and engine.message == "engine 'hf', configured 'vllm' (rollout_server.engine)"
    )


def test_version_mismatch_and_an_older_server() -> None:
    other = VersionResponse(version=3, model=TINY, engine="hf", stagectl_version="0.0.1")
    line = _version("server[0]", other)
    assert (
        line.status == "fail"
        and line.message == f"the server runs stagectl 0.0.1, this learner {stagectl.__version__}"
    )
    older = VersionResponse(version=3, model=TINY, engine="hf")  # from before the field existed
    assert _version("server[0]", older).status == "warn"


def test_a_closed_weight_stream_port_fails(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    info = VersionResponse(version=0, model=TINY, engine="hf", weight_stream_port=port)
    cfg = _servers(tmp_path, "http://127.0.0.1:9")
    assert cfg.rollouts is not None
    line = _weight_transport(cfg.rollouts, "server[0]", "http://127.0.0.1:9", info)
    assert line.status == "fail" and line.message.startswith(
        f"http: the weight-stream port 127.0.0.1:{port} does not"
    )
    collective = _servers(
        tmp_path,
        "http://127.0.0.1:9",
        custom={
            "extra": {
                "rollout_matching": {
                    "rollout_backend": "vllm",
                    "vllm": {
                        "server": {"servers": [{"base_url": "http://127.0.0.1:9"}]},
                        "sync": {
                            "transport": "collective",
                            "group_address": "192.0.2.1",
                        },  # TEST-NET: not ours
                    },
                }
            }
        },
    )
    assert collective.rollouts is not None
    line = _weight_transport(collective.rollouts, "server[0]", "http://127.0.0.1:9", info)
    assert line.status == "fail" and "cannot listen on group_address 192.0.2.1" in line.message


def test_push_round_trip(tmp_path: Path, server: ThreadedServer, bundle: ModelBundle) -> None:
    line = check_push(_servers(tmp_path, server.url), bundle)
    assert line.status == "ok" and " as version 1 over http in " in line.message, line
    assert _by_name(check_servers(_servers(tmp_path, server.url)))["server[0].version"].message.endswith(
        f"serving weight version 1 of {TINY}"
    )
    assert not (tmp_path / "run").exists()


def test_a_push_the_server_refuses_fails(
    tmp_path: Path, bundle: ModelBundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    other = _serve(tmp_path)  # serves the fake engine's own tensors, not this model's
    try:
        line = check_push(_servers(tmp_path, other.url), bundle)
    finally:
        other.stop()
    assert line.name == "server.push" and line.status == "fail"
    assert line.message.startswith("http push failed: ") and "another checkpoint" in line.fix


def test_an_unreadable_ca_file_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    bad_ca = tmp_path / "ca.pem"
    bad_ca.write_text("not a certificate")
    url = "https://127.0.0.1:9"
    servers = _servers(tmp_path, url)
    assert servers.rollouts is not None
    listed = dataclasses.replace(servers.rollouts.servers, tls_ca_file=bad_ca)  # past the config's own check
    servers = dataclasses.replace(servers, rollouts=dataclasses.replace(servers.rollouts, servers=listed))
    (line,) = check_servers(servers)
    assert line.name == "server.tls" and line.status == "fail"
    assert line.message.startswith(f"tls_ca_file: cannot load {bad_ca}")
