"""Serving: the bounds of one call come from the server's plan (the config's own caller: a train-ab
learner, a Stage-B runner). The listening socket says it is TCP, so asyncio turns Nagle off (TCP_NODELAY)
on every connection it accepts. Without it each answer, whose head and body uvicorn writes apart, waited
for the client's delayed ACK: a 44 ms floor under every request (measured: /health/ 44 ms -> 0.3 ms)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from stagectl.config import load_config
from stagectl.config.plan_server import server_plan
from stagectl.engines.fake import FakeEngine
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import bind_socket, settings_for
from stagectl.wire.guards import CallLimits, TooManyRequests, TooManyTokens
from stagectl.wire.protocol import InferBody, InferRequest, Message, RequestConfig


def test_accepted_connections_have_nagle_off() -> None:
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen: list[int] = []

    async def main() -> None:
        accepted = asyncio.Event()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                accepted_sock = transport.get_extra_info("socket")
                seen.append(accepted_sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                accepted.set()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            await asyncio.wait_for(accepted.wait(), 10)
            writer.close()

    asyncio.run(main())
    assert seen and seen[0] != 0


TRAIN_AB = [
    "data.synthetic.num_samples=8",
    "stage2_ab.schedule.b_ratio=0.5",
    "custom.extra.rollout_matching.rollout_backend=vllm",
    "rollout_server.embedded=true",
    "custom.extra.rollout_matching.max_new_tokens=10000",
    "stage2_ab.channel_b.rollout_decode_batch_size=2048",
]
STAGE_B = [
    "mission=m",
    "tickets=[t.jsonl]",
    "guidance.path=g.json",
    "sampler.grid=[{max_new_tokens: 9000}]",
    "runner.per_rank_rollout_batch_size=1500",
]


@pytest.mark.parametrize(
    ("overrides", "tokens", "requests"), [(TRAIN_AB, 10000, 2048), (STAGE_B, 9000, 1500)]
)
def test_the_server_of_a_train_ab_or_stage_b_config_enforces_its_callers_bounds(
    overrides: list[str], tokens: int, requests: int
) -> None:
    """A server started from the training (or Stage-B) YAML takes its own caller's largest call and longest
    rollout, and refuses one beyond either (413 / 400 over HTTP)."""
    settings = settings_for(server_plan(load_config(None, overrides)))
    assert settings.limits == CallLimits(tokens, requests)
    service = RolloutService(FakeEngine(batch_wait_ms=0), settings)
    try:
        one = [InferRequest(messages=[Message(role="user", content="hi")])]
        with pytest.raises(
            TooManyRequests, match=f"{requests + 1} requests in one call; .* at most {requests}"
        ):
            service.infer(
                InferBody(infer_requests=one * (requests + 1), request_config=RequestConfig(max_tokens=8))
            )
        with pytest.raises(
            TooManyTokens, match=f"max_tokens {tokens + 1} exceeds this server's cap of {tokens}"
        ):
            service.infer(InferBody(infer_requests=one, request_config=RequestConfig(max_tokens=tokens + 1)))
        (answer,) = service.infer(
            InferBody(infer_requests=one, request_config=RequestConfig(max_tokens=tokens))
        )
        assert answer.choices
    finally:
        service.close()


def test_the_listening_line_comes_once_the_server_accepts_requests() -> None:
    """`serve` prints the listening line from uvicorn's start-up, after the app's own start-up (and, in the
    main thread, uvicorn's signal handlers): a Ctrl-C right after it is a normal stop. Printed before
    `run`, a signal in between ended the process outside uvicorn, with no stop line."""
    import contextlib
    import threading
    import time
    from collections.abc import AsyncIterator
    from types import SimpleNamespace

    import httpx
    from fastapi import FastAPI

    from stagectl.server.serving import _uvicorn_server

    events: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        events.append("app started")
        yield

    app = FastAPI(lifespan=lifespan)
    # what `_uvicorn_server` reads (no TLS) and its shutdown calls
    app.state.service = SimpleNamespace(settings=ServerSettings(), stopping=False, stop_queued=lambda: None)

    @app.get("/health/")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    # where `serve` prints the listening line
    server = _uvicorn_server(app, on_started=lambda: events.append("listening"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while "listening" not in events and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events == ["app started", "listening"]
        assert server.started
        assert httpx.get(f"{url}/health/", timeout=5).status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def test_a_stop_answers_what_it_cuts_off_503_and_decodes_no_queued_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM with one call decoding past the graceful window and two queued behind it: the queued ones
    are answered 503 when `STOP_QUEUED_AFTER_S` passes, the running one 503 when the window ends, each
    with a JSON detail, and the engine never decodes the queued ones. Before: three plain-text 500s
    ("Internal Server Error", a traceback each in the log), then the engine's close decoded both queued
    calls for clients that were gone (219 s on the tiny model with 128 queued requests)."""

    from stagectl.server import serving
    from stagectl.server.app import build_app

    monkeypatch.setattr(serving, "GRACEFUL_SHUTDOWN_S", 1.0)
    monkeypatch.setattr(serving, "STOP_QUEUED_AFTER_S", 0.3)
    # one call at a time, each decoding far past the 1 s window: a stalled machine cannot let it finish
    engine = FakeEngine(max_batch_size=1, batch_wait_ms=0, step_delay_ms=4000)
    server = serving.ThreadedServer(build_app(RolloutService(engine, ServerSettings()))).start()
    answers = _three_calls_one_decoding(server)
    server.stop()
    details = _details(answers)
    assert [answers[k].status_code for k in range(3)] == [503, 503, 503]
    assert [d.split(";")[0] for d in details] == [
        "the rollout server is stopping (SIGTERM/SIGINT) and had not started this call",
        "the rollout server is stopping (SIGTERM/SIGINT) and had not started this call",
        "the rollout server stopped (SIGTERM/SIGINT) before this call finished",
    ]
    assert engine.batch_sizes() == {1: 1}  # only the call that was running when the stop came


def _three_calls_one_decoding(server: Any) -> dict[Any, Any]:
    """Three concurrent calls, started in threads: returns once the first is decoding and all three are in
    the server (their answers land in the dict the threads fill; `_details` waits for them)."""
    import threading

    import httpx

    body = {"infer_requests": [{"messages": [{"role": "user", "content": "hi"}]}]}
    answers: dict[Any, Any] = {"threads": []}

    def call(k: int) -> None:
        answers[k] = httpx.post(f"{server.url}/infer/", json=body, timeout=30)

    for k in range(3):
        caller = threading.Thread(target=call, args=(k,))
        caller.start()
        answers["threads"].append(caller)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(server._server.server_state.tasks) < 3:  # uvicorn's requests
        time.sleep(0.01)
    time.sleep(0.2)  # the first call is decoding (its batch takes seconds), the others wait behind it
    return answers


def _details(answers: dict[Any, Any]) -> list[str]:
    for caller in answers["threads"]:
        caller.join(15)
    assert [answers[k].status_code for k in range(3)] == [503, 503, 503], {
        k: answers.get(k) for k in range(3)
    }
    return sorted(answers[k].json()["detail"] for k in range(3))


def test_a_second_ctrl_c_answers_every_call_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force exit (a second Ctrl-C): the queued and the running call are answered 503 at once, long before
    the batch being decoded ends. Before, the engine's close blocked the event loop until that batch ended,
    so the answers waited for it (and said "before this call finished" for calls never started)."""
    from stagectl.server import serving
    from stagectl.server.app import build_app

    engine = FakeEngine(max_batch_size=1, batch_wait_ms=0, step_delay_ms=5000)
    server = serving.ThreadedServer(build_app(RolloutService(engine, ServerSettings()))).start()
    answers = _three_calls_one_decoding(server)
    uvicorn_server = server._server
    uvicorn_server.should_exit = True  # the first Ctrl-C: a graceful stop begins
    time.sleep(0.3)
    started = time.monotonic()
    uvicorn_server.force_exit = True  # the second
    details = _details(answers)
    answered_s = time.monotonic() - started
    server.stop()
    assert answered_s < 3.0, answered_s  # the decoding batch had more than 4 s left
    assert all(d.startswith("the rollout server") for d in details)
    assert engine.batch_sizes() == {1: 1}


def test_image_roots_and_weight_dirs_that_are_not_directories_are_named_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typo in `rollout_server.image_roots` served silently: the first image request came back 400."""
    from stagectl.server.serving import missing_dirs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "images").mkdir()
    settings = ServerSettings(
        image_roots=[tmp_path / "images", Path("runs/demo_dat")], weight_dirs=[tmp_path / "weights"]
    )
    assert missing_dirs(settings) == [
        f"rollout-server: warning: rollout_server.image_roots 'runs/demo_dat' (relative paths are read from the "
        f"working directory, {tmp_path}) is not a directory: requests naming files under it will be refused",
        f"rollout-server: warning: --weights-dir '{tmp_path / 'weights'}' is not a directory: requests naming "
        "files under it will be refused",
    ]


def test_a_prompt_beyond_the_context_names_its_request() -> None:
    """The 400 of a prompt + max_tokens beyond the engine's context named the lengths, not which request of
    the call it was."""
    service = RolloutService(FakeEngine(batch_wait_ms=0, max_model_len=64), ServerSettings())
    try:
        short = InferRequest(messages=[Message(role="user", content="hi")])
        long = InferRequest(messages=[Message(role="user", content="x" * 100)])
        body = InferBody(infer_requests=[short, long], request_config=RequestConfig(max_tokens=8))
        with pytest.raises(TooManyTokens, match=r"^infer_requests\[1\]: a prompt of \d+ tokens \+ "):
            service.infer(body)
    finally:
        service.close()
