"""Rollout-server hardening against hostile or broken clients, on the real app (FastAPI + uvicorn in a
thread) over the fake engine: slow clients, bodies without a declared length, and a source-level check
that nothing unpickles. The token, size-limit, path and weight-verification basics are in
tests/integration/test_rollout_fake_server.py,
tests/unit/wire/test_paths_fuzz.py and tests/unit/weightsync/test_wire_fuzz.py."""

from __future__ import annotations

import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stagectl.engines.fake import FakeEngine
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import ThreadedServer
from tests.faults.helpers import report

ROOT = Path(__file__).parents[2]
BODY_TIMEOUT_S = 1.5
INFER = {"infer_requests": [{"messages": [{"role": "user", "content": "hi"}]}]}


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    engine = FakeEngine(batch_wait_ms=0)
    settings = ServerSettings(max_request_bytes=64 * 1024, body_timeout_s=BODY_TIMEOUT_S)
    served = ThreadedServer(build_app(RolloutService(engine, settings))).start()
    yield served
    served.stop()
    engine.close()


def _address(server: ThreadedServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _trickle(server: ThreadedServer, head: bytes, body: bytes, outcome: dict[int, str], key: int) -> None:
    """Send `head` at once, then `body` one byte every 50 ms until the server answers or hangs up;
    record the status (or `closed`/`sent everything`) and when."""
    started = time.monotonic()
    answer = b""
    with socket.create_connection(_address(server), timeout=30) as sock:
        try:
            sock.sendall(head)
            for byte in body:
                if select.select([sock], [], [], 0)[0]:
                    answer = sock.recv(4096)
                    break
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
            else:
                outcome[key] = "sent everything"
                return
        except OSError:
            pass
    status = re.match(rb"HTTP/1\.1 (\d+)", answer)
    outcome[key] = (
        f"{status.group(1).decode() if status else 'closed'} after {time.monotonic() - started:.1f}s"
    )


def test_slow_clients_hold_no_worker_and_slow_bodies_time_out(server: ThreadedServer) -> None:
    """60 clients trickle a request body byte by byte and 20 more trickle their headers: normal requests
    are answered at once meanwhile, and each slow body ends with 408 at the body deadline."""
    body_head = (
        b"POST /infer/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\r\n"
    )
    header_head = b"POST /infer/ HTTP/1.1\r\nHost: x\r\n"
    outcome: dict[int, str] = {}
    threads = [
        threading.Thread(
            target=_trickle, args=(server, body_head, b"{" + b" " * 399, outcome, k), daemon=True
        )
        for k in range(60)
    ]
    threads += [
        threading.Thread(
            target=_trickle,
            args=(server, header_head, b"X-Slow: " + b"a" * 60, outcome, 100 + k),
            daemon=True,
        )
        for k in range(20)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)
    latencies = []
    for _ in range(5):
        started = time.monotonic()
        response = httpx.post(f"{server.url}/infer/", json=INFER, timeout=10)
        latencies.append(time.monotonic() - started)
        assert response.status_code == 200
    assert max(latencies) < 2.0, latencies  # no worker thread is held by the slow clients
    for t in threads:
        t.join(timeout=30)
    slow_bodies = [outcome.get(k, "") for k in range(60)]
    assert all(o.startswith("408 after") for o in slow_bodies), slow_bodies
    seconds = [float(o.split("after ")[1].rstrip("s")) for o in slow_bodies]
    assert max(seconds) < BODY_TIMEOUT_S + 5, seconds
    report(
        fault="60 slow-body + 20 slow-header clients",
        survived=True,
        normal_request_max_s=round(max(latencies), 3),
        slow_body_closed_after_max_s=max(seconds),
    )


def test_a_chunked_body_above_the_limit_is_413(server: ThreadedServer) -> None:
    """No Content-Length to check up front: the body is counted while it streams in."""

    def chunks() -> Iterator[bytes]:
        yield b'{"infer_requests": [{"messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 1024

    response = httpx.post(
        f"{server.url}/infer/", content=chunks(), headers={"Content-Type": "application/json"}, timeout=10
    )
    assert response.status_code == 413 and "exceeds" in response.json()["detail"]
    assert httpx.post(f"{server.url}/infer/", json=INFER, timeout=10).status_code == 200  # still serving


UNSAFE = [
    (re.compile(r"^\s*import pickle|^\s*from pickle|cPickle|dill|joblib\.load", re.M), "pickle"),
    (re.compile(r"torch\.load\((?![^)]*weights_only=True)"), "torch.load without weights_only=True"),
    (re.compile(r"yaml\.load\(|yaml\.unsafe_load|Loader=yaml\.(Unsafe)?Loader"), "unsafe YAML loading"),
    (re.compile(r"allow_pickle\s*=\s*True"), "numpy allow_pickle"),
    (re.compile(r"(?<![\w.])(eval|exec)\("), "eval/exec"),
    (re.compile(r"trust_remote_code\s*=\s*True"), "trust_remote_code"),
    (re.compile(r"shell\s*=\s*True"), "shell=True"),
]


def test_no_pickle_or_code_execution_paths_in_the_package() -> None:
    """Nothing in stagectl/ unpickles or evaluates data it reads (checkpoints load with
    weights_only=True; weights travel as safetensors; configs with yaml.safe_load)."""
    found = []
    for path in sorted((ROOT / "stagectl").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for pattern, what in UNSAFE:
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not found, "\n".join(found)
    torch_loads = sum(p.read_text().count("torch.load(") for p in (ROOT / "stagectl").rglob("*.py"))
    assert torch_loads >= 1  # the checkpoint loader is there, and it passed the weights_only check


def test_idle_and_trickling_header_connections_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that connects and sends nothing, or trickles a header without ever finishing it, is
    disconnected after the header timeout, while a normal request on the same server still works."""
    from stagectl.server import serving

    monkeypatch.setattr(serving, "HEADER_TIMEOUT_S", 1.0)
    engine = FakeEngine(batch_wait_ms=0)
    served = ThreadedServer(build_app(RolloutService(engine, ServerSettings()))).start()
    try:
        host, port = _address(served)
        idle = socket.create_connection((host, port))
        trickle = socket.create_connection((host, port))
        trickle.sendall(b"POST /infer/ HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        closed = {}
        while len(closed) < 2 and time.monotonic() - started < 10:
            for name, sock in (("idle", idle), ("trickle", trickle)):
                if name in closed:
                    continue
                ready, _, _ = select.select([sock], [], [], 0.1)
                if ready and sock.recv(1024) == b"":
                    closed[name] = time.monotonic() - started
            if "trickle" not in closed:
                trickle.sendall(b"X-Slow: 1\r\n")  # keeps trickling, never ends the headers
        assert set(closed) == {"idle", "trickle"}, "a header-less connection stayed open"
        assert max(closed.values()) < 5
        response = httpx.post(f"{served.url}/infer/", json=INFER, timeout=10)
        assert response.status_code == 200
        # a keep-alive connection gets a fresh deadline after each response, and is used normally
        with httpx.Client(timeout=10) as client:
            assert client.get(f"{served.url}/health/").status_code == 200
            time.sleep(0.3)
            assert client.get(f"{served.url}/health/").status_code == 200
        idle.close()
        trickle.close()
    finally:
        served.stop()
        engine.close()
    report(
        fault="idle + trickling-header connections",
        survived=True,
        closed_after_s=round(max(closed.values()), 2),
    )
