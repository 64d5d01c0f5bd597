"""Pure parts of the rollout client: contiguous parts, seed shifts, config and response helpers."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from stagectl.config.plan import ServerList, ServerRollouts
from stagectl.config.rollout import RolloutMatchingConfig
from stagectl.config.sampling import SamplingSpec
from stagectl.config.stage_b import StageBServerConfig
from stagectl.inference.client import ClientClosedError, RolloutClient, RolloutServerError, _Retryable
from stagectl.inference.requests import (
    contiguous_parts,
    detection_request,
    request_config,
    to_generation,
    with_seed_offset,
)
from stagectl.weightsync.client import WeightSyncClient
from stagectl.weightsync.disk import DiskSender
from stagectl.wire.protocol import InferResponse, RequestConfig
from tests.helpers import returns_within, trickle_server


@pytest.mark.parametrize(
    ("n", "parts", "expected"),
    [
        (10, 1, [(0, 10)]),
        (10, 3, [(0, 4), (4, 7), (7, 10)]),
        (2, 4, [(0, 1), (1, 2)]),
        (0, 2, []),
        (4, 2, [(0, 2), (2, 4)]),
    ],
)
def test_contiguous_parts(n: int, parts: int, expected: list[tuple[int, int]]) -> None:
    got = contiguous_parts(n, parts)
    assert got == expected
    assert sum(stop - start for start, stop in got) == n


def test_seed_offset_keeps_per_request_seeds() -> None:
    config = RequestConfig(seed=100, max_tokens=5)
    assert with_seed_offset(config, 3).seed == 103 and with_seed_offset(config, 3).max_tokens == 5
    assert with_seed_offset(config, 0) is config
    assert with_seed_offset(RequestConfig(), 3).seed is None


def test_detection_request_is_swift_style(tmp_path: Path) -> None:
    request = detection_request([tmp_path / "a.png", "rel/b.png"], "Find objects.")
    assert request.messages[0].content == "<image><image>Find objects."
    assert request.images[0] == str(tmp_path / "a.png")
    assert Path(request.images[1]).is_absolute()


def test_request_config_from_channel_b_sampling() -> None:
    rm = RolloutMatchingConfig.model_validate(
        {
            "max_new_tokens": 77,
            "decoding": {"temperature": 0.7, "top_p": 0.9, "top_k": 5},
            "repetition_penalty": 1.1,
        }
    )
    config = request_config(SamplingSpec.for_channel_b(rm), seed=123)
    assert (config.max_tokens, config.temperature, config.top_p, config.top_k) == (77, 0.7, 0.9, 5)
    assert config.repetition_penalty == 1.1 and config.seed == 123 and config.return_details
    assert not config.logprobs
    assert request_config(SamplingSpec.for_channel_b(rm, logprobs=True), seed=None).logprobs


def test_to_generation() -> None:
    response = InferResponse.model_validate(
        {
            "choices": [{"message": {"content": "x"}, "finish_reason": "length", "token_ids": [1, 2]}],
            "extra": 1,
        }
    )
    generation = to_generation(response)
    assert generation.token_ids == [1, 2] and generation.finish_reason == "length"
    with pytest.raises(ValueError, match="return_details"):
        to_generation(InferResponse.model_validate({"choices": [{"message": {"content": "x"}}]}))


def test_clients_of_the_plan_parts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Both clients are built from the plan's parts; a missing token is reported under the config key
    that names its variable (`ServerList.token_key`), whichever section the servers came from."""
    rm = RolloutMatchingConfig.model_validate(
        {
            "rollout_backend": "vllm",
            "vllm": {
                "server": {
                    "servers": [{"base_url": "http://127.0.0.1:1/"}],
                    "infer_timeout_s": 0,
                    "auth_token_env": "TOK",
                },
                "sync": {"transport": "disk"},
            },
        }
    )
    servers = ServerList.of_rollout_matching(rm)
    rollouts = ServerRollouts(servers, rm.vllm.sync.model_copy(update={"disk_dir": tmp_path}))
    stage_b = ServerList.of_stage_b(
        StageBServerConfig(base_urls=["http://127.0.0.1:3"], auth_token_env="TOK")
    )
    monkeypatch.delenv("TOK", raising=False)
    key = r"custom\.extra\.rollout_matching\.vllm\.server\.auth_token_env names \$TOK, which is unset"
    with pytest.raises(ValueError, match=key):
        RolloutClient.for_servers(servers)
    with pytest.raises(ValueError, match=key):
        WeightSyncClient.for_rollouts(rollouts)
    with pytest.raises(ValueError, match=r"^runner\.server\.auth_token_env names \$TOK"):
        RolloutClient.for_servers(stage_b)
    monkeypatch.setenv("TOK", "secret")
    with RolloutClient.for_servers(servers) as client:
        assert client.base_urls == ["http://127.0.0.1:1"]
        assert client._headers == {"Authorization": "Bearer secret"}
        assert client.timeout_s == servers.wait_healthy_s and client._timeout.read is None  # 0: none
    with WeightSyncClient.for_rollouts(rollouts) as sync:
        assert sync.base_urls == ["http://127.0.0.1:1"] and isinstance(sync.sender, DiskSender)
        assert sync.transport == "disk" and sync.disk_dir == tmp_path
    with RolloutClient.for_servers(stage_b) as client:
        assert client.base_urls == ["http://127.0.0.1:3"]


def test_a_call_cut_off_by_close_is_not_retried(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Shutdown closes the client under a call in flight: that call ends with `ClientClosedError`, without
    the "retrying on a fresh connection" warning, a retry, or a failure counted."""
    client = RolloutClient(["http://127.0.0.1:9"])
    posts: list[bool] = []

    def post_cut_off(k: int, body: object, *, fresh: bool) -> list[InferResponse]:
        posts.append(fresh)
        client.close()  # what the owner's shutdown does while the call waits on its socket
        raise _Retryable("ReadError: [Errno 9] Bad file descriptor", gone=True)

    monkeypatch.setattr(client, "_post_infer", post_cut_off)
    request = detection_request(["a.png"], "Find objects.")
    with (
        caplog.at_level("WARNING", logger="stagectl.rollout.client"),
        pytest.raises(ClientClosedError, match="the client was closed"),
    ):
        client.infer([request], RequestConfig(seed=1))
    assert posts == [False]
    assert caplog.records == []
    assert client.counters()["retries"] == 0 and client.counters()["failed_calls"] == 0


def test_a_failed_call_of_an_open_client_is_retried_once_on_a_fresh_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = RolloutClient(["http://127.0.0.1:9"])
    posts: list[bool] = []
    answer = InferResponse.model_validate({"choices": [{"message": {"content": "{}"}, "token_ids": [1]}]})

    def post_once_failing(k: int, body: object, *, fresh: bool) -> list[InferResponse]:
        posts.append(fresh)
        if not fresh:
            raise _Retryable("ReadError: connection reset", gone=True)
        return [answer]

    monkeypatch.setattr(client, "_post_infer", post_once_failing)
    got = client.infer([detection_request(["a.png"], "Find objects.")], RequestConfig(seed=1))
    assert got == [answer] and posts == [False, True]
    assert client.counters()["retries"] == 1
    client.close()


def test_retries_while_a_server_is_down_log_one_line_per_server_every_30_s(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One outage, many chunks (each retried): one "retrying" line per server every 30 s, the next one saying
    how many were left out, instead of a line per chunk; every retry is still counted."""
    import stagectl.console

    clock = [1000.0]
    monkeypatch.setattr(stagectl.console.time, "monotonic", lambda: clock[0])
    client = RolloutClient(["http://127.0.0.1:9"])
    answer = InferResponse.model_validate({"choices": [{"message": {"content": "{}"}, "token_ids": [1]}]})

    def post_first_failing(k: int, body: object, *, fresh: bool) -> list[InferResponse]:
        if not fresh:
            raise _Retryable("ReadError: connection reset", gone=True)
        return [answer]

    monkeypatch.setattr(client, "_post_infer", post_first_failing)
    with caplog.at_level("WARNING", logger="stagectl.rollout.client"):
        for _ in range(5):  # a chunk every 10 s
            client.infer([detection_request(["a.png"], "Find objects.")], RequestConfig(seed=1))
            clock[0] += 10.0
    client.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("retrying on a fresh connection" in line for line in lines)
    assert lines[1].endswith("(2 more like it in the last 30 s)")  # at 1030 s, after 1010 and 1020
    assert client.counters()["retries"] == 5


def test_a_wait_for_health_says_once_what_it_waits_for_then_names_the_server_that_never_answered() -> None:
    client = RolloutClient(["http://127.0.0.1:9"], timeout_s=0.6)  # port 9 (discard): nothing listens
    lines: list[str] = []
    try:
        with pytest.raises(
            TimeoutError, match=r"not healthy after 0\.6 s: http://127\.0\.0\.1:9 \(ConnectError"
        ):
            client.wait_healthy(on_wait=lines.append, wait_key="x.timeout_s")
    finally:
        client.close()
    assert len(lines) == 1  # one line, not one per probe
    assert lines[0].startswith(
        "waiting up to 0.6 s (x.timeout_s) for /health/ of http://127.0.0.1:9 (ConnectError"
    )


def test_a_call_that_times_out_names_the_timeout_and_the_key_that_sets_it() -> None:
    """A server that accepts the connection and never answers: the error says how long the client waited
    and which config key sets it (httpx's own text is only "timed out")."""
    import socket

    stage_b = ServerList.of_stage_b(StageBServerConfig(base_urls=["http://127.0.0.1:1"], infer_timeout_s=0.2))
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nobody ever reads or answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        client = RolloutClient.for_servers(dataclasses.replace(stage_b, base_urls=(url,)))
        with client, pytest.raises(RolloutServerError) as raised:
            client.infer([detection_request(["a.png"], "Find objects.")], RequestConfig(seed=1))
    message = str(raised.value)
    assert "no whole answer within 0.2 s (runner.server.infer_timeout_s sets it)" in message
    assert url in message


@pytest.mark.parametrize("head", [b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"])
def test_a_server_that_trickles_its_answers_holds_no_call_past_its_timeout(head: bytes) -> None:
    """A byte every 0.1 s (of the headers, or of the body) never trips a per-read timeout: `/infer/`,
    `/version/` and the wait for `/health/` each end at their whole-call bound (all three hung forever)."""
    from stagectl.wire.deadline import CallDeadlineError

    request = detection_request(["a.png"], "Find objects.")
    with trickle_server(every_s=0.1, head=head) as url:
        client = RolloutClient(
            [url], timeout_s=0.8, infer_timeout_s=0.5, infer_timeout_key="k.infer_timeout_s"
        )
        infer = r"no whole answer within 0\.5 s \(k\.infer_timeout_s"
        with pytest.raises(RolloutServerError, match=infer):  # after a try and a retry
            returns_within(3.0, lambda: client.infer([request], RequestConfig(seed=1)))
        with pytest.raises(CallDeadlineError, match=r"/version/: no whole answer within 0\.5 s"):
            returns_within(2.0, client.versions)
        with pytest.raises(TimeoutError, match=r"not healthy after 0\.8 s: .*CallDeadlineError"):
            returns_within(3.0, client.wait_healthy)
    client.close()  # after the server is gone: a call it still held has ended


def test_close_ends_the_calls_still_waiting_on_trickling_servers() -> None:
    """Two servers trickling their answers, each share of a call in a pool thread: `close` (what a second
    Ctrl-C runs on its way out) ends both calls at once instead of waiting out `infer_timeout_s` (30 s here;
    a stopped stage-b or train-ab waited up to 600 s), and the call raises `ClientClosedError`."""
    import threading

    requests = [detection_request(["a.png"], "Find objects.")] * 2
    with trickle_server(every_s=0.1) as first, trickle_server(every_s=0.1) as second:
        client = RolloutClient([first, second], infer_timeout_s=30.0)
        outcome: list[BaseException] = []

        def call() -> None:
            try:
                client.infer(requests, RequestConfig(seed=1))
            except BaseException as exc:  # handed to the test thread
                outcome.append(exc)

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        time.sleep(0.5)  # both shares are in flight, reading a byte every 0.1 s
        _, seconds = returns_within(3.0, client.close)
        caller.join(3.0)
    assert seconds < 2.0
    assert len(outcome) == 1 and isinstance(outcome[0], ClientClosedError), outcome


def test_close_ends_a_retry_whose_fresh_connection_was_made_as_it_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call whose first try failed builds a fresh client for its retry; `close` coming while it was being
    built aborted the clients registered so far, not that one: its retry on a trickling server held the close
    for the whole `infer_timeout_s` (600 s by default)."""
    import threading

    import httpx

    request = detection_request(["a.png"], "Find objects.")
    closing: list[float] = []
    with trickle_server(every_s=0.1) as url:
        client = RolloutClient([url], infer_timeout_s=5.0)

        def reset(*args: object, **kwargs: object) -> httpx.Response:
            raise httpx.ReadError("connection reset")  # the first try, on the kept connection

        monkeypatch.setattr(client._clients[0], "post", reset)
        build = client._new_http

        def built_as_it_closes() -> object:
            http = build()

            def close() -> None:
                start = time.monotonic()
                client.close()
                closing.append(time.monotonic() - start)

            threading.Thread(target=close, daemon=True).start()
            while not client._closed.is_set():
                time.sleep(0.01)
            time.sleep(0.2)  # `close` has aborted what was registered and waits for the pool's threads
            return http

        monkeypatch.setattr(client, "_new_http", built_as_it_closes)
        with pytest.raises(ClientClosedError):
            returns_within(4.0, lambda: client.infer([request], RequestConfig(seed=1)))
        deadline = time.monotonic() + 4.0
        while not closing and time.monotonic() < deadline:
            time.sleep(0.05)
    assert closing and closing[0] < 2.0, closing


def test_a_request_a_live_server_fails_twice_is_told_from_a_server_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prefetcher gives an outage's samples back to the retry but loses those of a request that failed
    on its own (it may fail at every retry): the client's errors tell the two apart."""
    from stagectl.wire.errors import RolloutRequestFailedError

    request = detection_request(["a.png"], "Find objects.")
    cases = [
        (_Retryable("HTTP 500: bad sample", status=500), True),
        (_Retryable("HTTP 503: stopping", status=503), False),  # a server stopping or busy: an outage
        (_Retryable("ReadTimeout: no answer"), False),
        (_Retryable("ConnectError: refused", gone=True), False),
    ]
    for failure, expected_failed_on_its_own in cases:
        client = RolloutClient(["http://127.0.0.1:9"])

        def post_failing(k: int, body: object, *, fresh: bool, failure: _Retryable = failure) -> None:
            raise failure

        monkeypatch.setattr(client, "_post_infer", post_failing)
        with client, pytest.raises(RolloutServerError) as raised:
            client.infer([request], RequestConfig(seed=1))
        assert isinstance(raised.value, RolloutRequestFailedError) == expected_failed_on_its_own, raised.value
