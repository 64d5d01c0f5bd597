"""Running the rollout server: plan -> engine + service + app, bind, print the address, serve.

`run_server` is what `stagectl rollout-server` calls: it binds the socket itself (port 0 picks a free
one), prints `rollout-server: listening on http(s)://HOST:PORT` on stdout for a parent process to read,
then runs uvicorn, which shuts down gracefully on SIGTERM/SIGINT (in-flight requests finish, then the
engine stops). `ThreadedServer` runs an app in a background thread (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from stagectl.config.plan_server import ServerPlan
from stagectl.config.rollout import (
    DEFAULT_MAX_NEW_TOKENS_CAP,
    DEFAULT_MAX_REQUESTS_PER_CALL,
    RolloutServerConfig,
)
from stagectl.config.root import LOOPBACK_HOSTS
from stagectl.engines.interface import Engine
from stagectl.files import cwd_note
from stagectl.server.app import ACCESS_LOGGER, build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.wire.guards import CallLimits
from stagectl.wire.protocol import LISTENING_PREFIX, read_token
from stagectl.wire.tls import server_context

log = logging.getLogger("stagectl.rollout.server.serving")

GRACEFUL_SHUTDOWN_S = 30  # after SIGTERM/SIGINT, requests in flight get this long to finish
# then the calls the engine has not started are answered 503, leaving the running one the last 10 s
STOP_QUEUED_AFTER_S = 20
STOPPING_LINE = (
    "rollout-server: stopping: requests in flight get {s} s to finish (Ctrl-C again: answer them now)"
)
HEADER_TIMEOUT_S = 10.0  # request line + headers must arrive within this after connecting


def server_settings(
    rs: RolloutServerConfig, weight_dirs: Sequence[Path] = (), limits: CallLimits | None = None
) -> ServerSettings:
    token = read_token(rs.auth_token_env, "rollout_server.auth_token_env")
    if rs.host not in LOOPBACK_HOSTS and token is None:
        raise ValueError(
            f"rollout_server.host {rs.host!r} is beyond loopback: set rollout_server.auth_token_env "
            "(a bearer token protects every endpoint but /health/) or bind 127.0.0.1"
        )
    if rs.open_infer and rs.host not in LOOPBACK_HOSTS and not rs.open_infer_beyond_loopback:
        raise ValueError(
            f"rollout_server.open_infer: the server binds {rs.host!r} (beyond loopback); set "
            "rollout_server.open_infer_beyond_loopback: true to let anyone who reaches it generate"
        )
    return ServerSettings(
        image_roots=list(rs.image_roots),
        weight_dirs=list(weight_dirs),
        auth_token=token,
        open_infer=rs.open_infer,
        limits=limits
        or CallLimits(
            rs.max_new_tokens_cap or DEFAULT_MAX_NEW_TOKENS_CAP,
            rs.max_requests_per_call or DEFAULT_MAX_REQUESTS_PER_CALL,
        ),
        max_request_bytes=rs.max_request_bytes,
        max_weight_chunk_bytes=rs.max_weight_chunk_bytes,
        weight_stream_host=rs.host,
        weight_stream_port=rs.weight_stream_port,
        tls_certfile=rs.tls_certfile,
        tls_keyfile=rs.tls_keyfile,
    )


def build_engine(plan: ServerPlan) -> Engine:
    """The configured engine serving `plan.model`: as the learner loads it, with the coordinate tokens, for
    a train-ab config (the embedded server, or one started from the training YAML), else the checkpoint
    unchanged."""
    rs, model = plan.server, plan.model
    if rs.engine == "hf":
        import torch

        from stagectl.engines.hf import HFEngine
        from stagectl.models.loading import load_bundle

        bundle = load_bundle(
            model.name_or_path,
            # adapter syncs merge onto the float32 base (as the learner's checkpoints do), then serve the dtype
            torch_dtype="float32" if model.adapter_sync else model.torch_dtype,
            device="cuda" if torch.cuda.is_available() else "cpu",
            attn_implementation=model.attn_implementation,
            add_coord_tokens=model.coord_tokens,
        )
        merger = None
        if model.adapter is not None:
            from stagectl.engines.hf_adapter import AdapterMerger

            merger = AdapterMerger(bundle.model, model.adapter)
            bundle.model.to(getattr(torch, model.torch_dtype))
        return HFEngine(
            bundle,
            model_name=model.name_or_path,
            max_batch_size=rs.max_batch_size,
            batch_wait_ms=rs.batch_wait_ms,
            adapter=merger,
            kv_cache=rs.hf_kv_cache,
        )
    from stagectl.engines.vllm import VllmEngine
    from stagectl.models.loading import resolve_model_path

    return VllmEngine(
        resolve_model_path(model.name_or_path),
        rs.vllm,
        model_name=model.name_or_path,
        dtype=model.torch_dtype,
        max_batch_size=rs.max_batch_size,
        batch_wait_ms=rs.batch_wait_ms,
        coord_tokens=model.coord_tokens,
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; connections queue in its backlog until uvicorn accepts them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without
    # it every answer (head and body written apart) waited ~40 ms for the client's delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    return sock


def url_of(sock: socket.socket, *, tls: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _uses_tls(app: FastAPI) -> bool:
    settings: ServerSettings = app.state.service.settings
    return settings.tls_certfile is not None


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a header-read timeout: a connection whose request line and headers have
    not arrived within `HEADER_TIMEOUT_S` of connecting (or of its last response) is closed, so idle or
    trickling clients cannot pile up open sockets. (Request bodies have their own deadline in the app.)"""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and self._header_timer is not None:
            self._header_timer.cancel()  # a request is under way: its headers arrived in time
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()  # the next request on this keep-alive connection has the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.cycle is None and not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server that calls `on_started` once it listens: after its signal handlers are in place and
    the app's start-up has run, so a Ctrl-C right after the listening line is a normal, clean stop (printed
    before `run`, a signal in between raised KeyboardInterrupt outside uvicorn: no stop line, and Python's
    "coroutine 'Server.serve' was never awaited" warning)."""

    def __init__(
        self,
        config: uvicorn.Config,
        service: RolloutService,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.service = service
        self.on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit and self.on_started is not None:
            self.on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """The graceful stop: requests in flight get `GRACEFUL_SHUTDOWN_S`; calls the engine has not started
        `STOP_QUEUED_AFTER_S` in are answered 503 then (a second Ctrl-C: at once), and a call still running
        at the end is answered 503 by the app (`app.CutOffAtStop`). Without this, uvicorn answered those a
        plain-text 500 with a traceback, and the engine's close then decoded every queued call (minutes) for
        clients that were gone."""
        log.info(STOPPING_LINE.format(s=GRACEFUL_SHUTDOWN_S))
        self.service.stopping = True
        timer = asyncio.get_running_loop().call_later(STOP_QUEUED_AFTER_S, self.service.stop_queued)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            timer.cancel()
            if self.force_exit:  # uvicorn skips the app's shutdown then, and asyncio cancels it: a traceback
                await self._answer_at_once()
                await self.lifespan.shutdown()

    async def _answer_at_once(self) -> None:
        """A second Ctrl-C: calls the engine has not started get their 503 ("had not started"), running ones
        are cut off (`app.CutOffAtStop` answers 503), and the answers go out before the engine is closed (the
        close waits for the batch it is decoding)."""
        self.service.stop_queued()
        for task in self.server_state.tasks:
            task.cancel(msg="stopped at once (a second Ctrl-C)")
        for _ in range(10):  # let the cancelled handlers send their answers (each needs a few loop turns)
            if not self.server_state.tasks:
                break
            await asyncio.sleep(0.05)


def _uvicorn_server(app: FastAPI, on_started: Callable[[], None] | None = None) -> _Server:
    settings: ServerSettings = app.state.service.settings
    if settings.tls_certfile is not None and settings.tls_keyfile is not None:
        server_context(settings.tls_certfile, settings.tls_keyfile)  # a clear error naming the files, now
    config = uvicorn.Config(
        app,
        log_level="warning",  # uvicorn's start-up chatter stays out of our output; its errors still show
        access_log=False,  # our AccessLog middleware writes one JSON line per request (`configure_access_log`)
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=HeaderTimeoutH11Protocol,
        ssl_certfile=settings.tls_certfile,  # uvicorn's own TLS: the listening socket serves https
        ssl_keyfile=settings.tls_keyfile,
    )
    return _Server(config, app.state.service, on_started)


def configure_access_log(target: str | None) -> None:
    """Where the per-request JSON lines (`stagectl.rollout.access`, both ports) go: None drops them, `-`
    writes them to stderr, anything else is a file they are appended to (created with its directory)."""
    access = logging.getLogger(ACCESS_LOGGER)
    for old in list(access.handlers):
        access.removeHandler(old)
        old.close()
    access.propagate = False
    access.setLevel(logging.INFO)
    if target is None:
        access.addHandler(logging.NullHandler())
        access.setLevel(logging.WARNING)
        return
    if target == "-":
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
    else:
        path = Path(target)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(path, encoding="utf-8")
        except OSError as exc:  # a directory, no permission, a read-only file system: before the model loads
            raise ValueError(f"--access-log {target}: cannot open it for appending ({exc})") from None
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)


def missing_dirs(settings: ServerSettings) -> list[str]:
    """A warning line for each `image_roots` entry and `--weights-dir` that is not a directory: the server
    serves anyway (the directory may appear later), but every request naming a file under it is refused,
    which a typo otherwise shows only at the first request, as a 400 of a client."""
    lines = []
    for key, dirs in (
        ("rollout_server.image_roots", settings.image_roots),
        ("--weights-dir", settings.weight_dirs),
    ):
        for entry in dirs:
            if not entry.expanduser().is_dir():
                lines.append(
                    f"rollout-server: warning: {key} {str(entry)!r}{cwd_note(entry)} is not a directory: "
                    "requests naming files under it will be refused"
                )
    return lines


def run_server(plan: ServerPlan, *, weight_dirs: Sequence[Path] = (), access_log: str | None = None) -> None:
    """Load the engine, bind, print the address, serve until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    configure_access_log(access_log)
    # fail on a bad token or TLS setup before loading the model
    settings = settings_for(plan, weight_dirs)
    for line in missing_dirs(settings):
        print(line, file=sys.stderr, flush=True)
    if settings.tls_certfile is not None and settings.tls_keyfile is not None:
        server_context(settings.tls_certfile, settings.tls_keyfile)
    sock = bind_socket(plan.server.host, plan.server.port)
    serve(build_app(RolloutService(build_engine(plan), settings)), sock)


def settings_for(plan: ServerPlan, weight_dirs: Sequence[Path] = ()) -> ServerSettings:
    """Everything the server's service takes from its plan (and `--weights-dir`): `server_settings` with
    the call limits and the weight-sync routes it mounts."""
    limits = CallLimits(plan.max_new_tokens_cap, plan.max_requests_per_call)
    settings = server_settings(plan.server, weight_dirs, limits)
    return dataclasses.replace(settings, weight_transports=plan.weight_transports)


def serve(app: FastAPI, sock: socket.socket) -> None:
    """Serve `app` on `sock` until SIGTERM/SIGINT, printing the listening line once it accepts requests."""
    line = f"{LISTENING_PREFIX}{url_of(sock, tls=_uses_tls(app))}"
    server = _uvicorn_server(app, on_started=lambda: print(line, flush=True))
    server.run(sockets=[sock])


class ThreadedServer:
    """Serve `app` on a background thread at 127.0.0.1 (a free port unless given); `stop()` shuts it down."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = _uvicorn_server(app)
        self._sock = bind_socket(host, port)
        self.url = url_of(self._sock, tls=_uses_tls(app))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="rollout-server", daemon=True
        )

    def start(self, timeout_s: float = 30.0) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the threaded rollout server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=GRACEFUL_SHUTDOWN_S + 5)
        self._sock.close()
