"""The rollout server's HTTP layer: FastAPI routes over a `RolloutService`, the bearer-token check (every
route but `/health/`), the request-size limit, the request-body deadline and the structured access log.
Endpoints are in `wire/protocol.py` and `weightsync/protocol.py`; each weight-sync transport brings its own
routes (`weightsync/{http,collective,disk}_routes.py`), mounted when the service built its receiver; the guards
themselves are in `wire/guards.py`."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stagectl.engines.interface import EngineStopping
from stagectl.server.service import BadRequest, RolloutService
from stagectl.weightsync import collective_routes, disk_routes, http_routes
from stagectl.weightsync.errors import WeightSyncError, status_of
from stagectl.weightsync.gate import WrongVersion
from stagectl.weightsync.protocol import WEIGHT_CHUNK_PATH, AbortBody
from stagectl.weightsync.stream import WeightStreamServer
from stagectl.wire.guards import (
    BodyBudget,
    BodyTimeout,
    BodyTooLarge,
    TooManyRequests,
    TooManyTokens,
    Unauthorized,
    check_token,
    validation_detail,
)
from stagectl.wire.paths import PathRefused
from stagectl.wire.protocol import (
    HealthResponse,
    InferBody,
    RolloutItem,
    StatsResponse,
    VersionResponse,
    WorldSizeResponse,
)

ACCESS_LOGGER = "stagectl.rollout.access"
STOPPED_LINE = "rollout-server: stopped (in-flight requests answered, engine closed)"
# the logger names from before the move to stagectl/server/: log filters keep working
log = logging.getLogger("stagectl.rollout.server.app")
access_log = logging.getLogger(ACCESS_LOGGER)
CLOSE = {"Connection": "close"}  # on 408/413 the rest of the body is not read: end the connection

T = TypeVar("T")


def _service(request: Request) -> RolloutService:
    service = request.app.state.service
    assert isinstance(service, RolloutService)
    return service


# Handlers below are `async def` unless they block: FastAPI runs plain `def` handlers (and dependencies) on
# one shared thread pool, which concurrent /infer/ calls can fill while they wait on the engine; health,
# version and stats answers and weight syncs must not queue behind them. Weight operations run on the
# app's own small executor (`weight_executor`).


async def _weight_call(request: Request, func: Callable[..., T], *args: Any) -> T:
    executor = request.app.state.weight_executor
    assert isinstance(executor, ThreadPoolExecutor)
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(func, *args))


async def require_token(request: Request) -> None:
    """Every route but `/health/`: `Authorization: Bearer <token>` when the server has a token (401 otherwise)."""
    try:
        check_token(request.headers.get("authorization"), _service(request).settings.auth_token)
    except Unauthorized as exc:
        raise HTTPException(401, str(exc), headers={"WWW-Authenticate": "Bearer"}) from None


async def require_token_unless_open_infer(request: Request) -> None:
    """The swift contract's routes (`/infer/`, `/get_world_size/`): open when `rollout_server.open_infer`."""
    if not _service(request).settings.open_infer:
        await require_token(request)


# The dependency sits on the router, so no protected route can forget it; `/health/` alone is outside. Each
# weight-sync transport brings its own routes (`weightsync.*_routes`), mounted behind the same dependency.
health_router = APIRouter()
swift_router = APIRouter(dependencies=[Depends(require_token_unless_open_infer)])
router = APIRouter(dependencies=[Depends(require_token)])


@health_router.get("/health/")
@health_router.get("/health", include_in_schema=False)  # vLLM's path and a probe's habit: 200, not a bare 307
async def health(request: Request) -> HealthResponse:
    return HealthResponse(instance_id=_service(request).instance_id)


@swift_router.get("/get_world_size/")
async def get_world_size() -> WorldSizeResponse:
    return WorldSizeResponse(world_size=1)


@router.get("/version/")
async def version(request: Request) -> VersionResponse:
    return _service(request).version()


@router.get("/stats/")
async def stats(request: Request) -> StatsResponse:
    return _service(request).stats()


@swift_router.post("/infer/")
def infer(body: InferBody, request: Request) -> list[RolloutItem]:
    # A plain `def`: FastAPI runs it on its thread pool, so concurrent calls reach the batching worker together.
    return [RolloutItem.of(response) for response in _service(request).infer(body)]


@router.post("/update_weights/abort/")
async def abort(body: AbortBody, request: Request) -> dict[str, bool]:
    return {"aborted": await _weight_call(request, _service(request).sync.abort, body.sync_id)}


def _wrong_version(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=409)


def _too_many_requests(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=413)


def _bad_request(request: Request, exc: Exception) -> JSONResponse:
    status = status_of(exc) if isinstance(exc, WeightSyncError) else 400
    return JSONResponse({"detail": str(exc)}, status_code=status)


def _stopping(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=503, headers=CLOSE)


def _unprocessable(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    detail, errors = validation_detail(exc.errors(), request.headers.get("content-type", ""))
    return JSONResponse({"detail": detail, "errors": errors}, status_code=422)


class BodyLimit:
    """413 for bodies above the limit of their path (declared Content-Length, or counted while streaming);
    408 when the body has not fully arrived `body_timeout_s` after the request started. Bodies are read
    on the event loop, so a client trickling one byte at a time holds no worker thread; the deadline
    makes sure it does not hold its connection forever either."""

    def __init__(self, app: ASGIApp, limit_for: Callable[[str], int], body_timeout_s: float) -> None:
        self.app = app
        self.limit_for = limit_for
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        budget = BodyBudget(self.limit_for(scope["path"]), self.body_timeout_s)
        declared = dict(scope["headers"]).get(b"content-length")
        try:
            if declared is not None and declared.isdigit():
                budget.declared(int(declared))
        except BodyTooLarge as exc:
            await JSONResponse({"detail": str(exc)}, 413, headers=CLOSE)(scope, receive, send)
            return
        received = 0
        complete = False

        async def limited() -> Message:
            nonlocal received, complete
            if complete:  # after the body: only the disconnect notice, which may come much later
                return await receive()
            try:
                left_s = budget.remaining_s()  # before `receive()` makes a coroutine it would then drop
                message = await asyncio.wait_for(receive(), left_s)
                received += len(message.get("body", b""))
                budget.received(received)
            except TimeoutError:
                raise HTTPException(408, str(budget.expired()), headers=CLOSE) from None
            except BodyTimeout as exc:
                raise HTTPException(408, str(exc), headers=CLOSE) from None
            except BodyTooLarge as exc:
                raise HTTPException(413, str(exc), headers=CLOSE) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, limited, send)


class CutOffAtStop:
    """A request still running when the graceful shutdown ends (`serving.GRACEFUL_SHUTDOWN_S` after
    SIGTERM/SIGINT) is cancelled by uvicorn, which then answered a plain-text 500 and logged the
    `CancelledError` traceback: answer it 503 with a JSON detail instead, and end the request quietly."""

    def __init__(self, app: ASGIApp, service: RolloutService) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            if started or not self.service.stopping:
                raise
            detail = "the rollout server stopped (SIGTERM/SIGINT) before this call finished; send it to another server"
            await JSONResponse({"detail": detail}, 503, headers=CLOSE)(scope, receive, send)


class AccessLog:
    """One JSON line per request on the `stagectl.rollout.access` logger."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            client = scope.get("client")
            entry: dict[str, Any] = {
                "ts": round(time.time(), 3),
                "event": "access",
                "method": scope["method"],
                "path": scope["path"],
                "status": status,
                "ms": round((time.perf_counter() - start) * 1000, 2),
                "client": f"{client[0]}:{client[1]}" if client else None,
            }
            access_log.info(json.dumps(entry))


def build_app(service: RolloutService) -> FastAPI:
    """The ASGI app; closes the service (stops the engine) at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings = service.settings
        stream = None
        if settings.weight_stream_port is not None and service.http is not None:
            stream = WeightStreamServer(
                service.http, settings, settings.weight_stream_host, settings.weight_stream_port
            )
            service.weight_stream_port = stream.start().port
        try:
            yield
        finally:
            if stream is not None:
                service.weight_stream_port = None
                stream.stop()
            # off the event loop: the engine's close waits for the batch it is decoding, and answers still in
            # flight (a second Ctrl-C's 503s) need the loop meanwhile
            await asyncio.to_thread(app.state.weight_executor.shutdown, True)
            await asyncio.to_thread(service.close)
            log.info(STOPPED_LINE)  # uvicorn runs at warning: this is the line that says shutdown finished

    app = FastAPI(title="stagectl rollout server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    app.state.weight_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="weight-sync")
    for routes in (health_router, swift_router, router):
        app.include_router(routes)

    async def off_loop(func: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            app.state.weight_executor, functools.partial(func, *args)
        )

    # the configured transports' receivers and routes only (`ServerSettings.weight_transports`)
    token = [Depends(require_token)]
    if service.http is not None:
        app.include_router(http_routes.routes(service.http, off_loop), dependencies=token)
    if service.collective is not None:
        app.include_router(collective_routes.routes(service.collective, off_loop), dependencies=token)
    if service.disk is not None:
        app.include_router(disk_routes.routes(service.disk, off_loop), dependencies=token)
    for error in (BadRequest, PathRefused, WeightSyncError, TooManyTokens):
        app.add_exception_handler(error, _bad_request)
    app.add_exception_handler(TooManyRequests, _too_many_requests)
    app.add_exception_handler(EngineStopping, _stopping)
    app.add_exception_handler(WrongVersion, _wrong_version)
    app.add_exception_handler(RequestValidationError, _unprocessable)
    settings = service.settings

    def limit_for(path: str) -> int:
        return settings.max_weight_chunk_bytes if path == WEIGHT_CHUNK_PATH else settings.max_request_bytes

    app.add_middleware(BodyLimit, limit_for=limit_for, body_timeout_s=settings.body_timeout_s)
    app.add_middleware(CutOffAtStop, service=service)  # inside the access log: its 503 is logged as sent
    app.add_middleware(AccessLog)
    return app
