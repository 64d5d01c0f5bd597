"""The rollout server's HTTP layer: FastAPI routes over a `RolloutService`, the bearer-token check (every
route but `/health/`), the request-size limit, the request-body deadline and the structured access log.
Endpoints are in `wire/protocol.py` and `weightsync/protocol.py`; the guards themselves in `guards.py`."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stagectl.server.service import BadRequest, RolloutService
from stagectl.weightsync.collective import GroupError, GroupInfo, GroupReceiver
from stagectl.weightsync.disk import DiskReceiver
from stagectl.weightsync.errors import WeightSyncError, status_of
from stagectl.weightsync.gate import WrongVersion
from stagectl.weightsync.http import HttpReceiver
from stagectl.weightsync.protocol import (
    WEIGHT_CHUNK_PATH,
    AbortBody,
    ChunkQuery,
    ChunkResponse,
    CommitBody,
    DiskSyncBody,
    GroupFinishBody,
    GroupInitBody,
    GroupStartBody,
    SyncResponse,
)
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
log = logging.getLogger("stagectl.rollout.server.app")
access_log = logging.getLogger(ACCESS_LOGGER)
CLOSE = {"Connection": "close"}  # on 408/413 the rest of the body is not read: end the connection

T = TypeVar("T")


def _service(request: Request) -> RolloutService:
    service = request.app.state.service
    assert isinstance(service, RolloutService)
    return service


# A transport's routes are mounted only where the service built its receiver (`weight_transports`).
def _http(request: Request) -> HttpReceiver:
    receiver = _service(request).http
    assert receiver is not None
    return receiver


def _collective(request: Request) -> GroupReceiver:
    receiver = _service(request).collective
    assert receiver is not None
    return receiver


def _disk(request: Request) -> DiskReceiver:
    receiver = _service(request).disk
    assert receiver is not None
    return receiver


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


# The dependency sits on the router, so no protected route can forget it; `/health/` alone is outside.
health_router = APIRouter()
swift_router = APIRouter(dependencies=[Depends(require_token_unless_open_infer)])
router = APIRouter(dependencies=[Depends(require_token)])
# one router per weight-sync transport: the app mounts those whose receiver the service built (the
# transports in `ServerSettings.weight_transports`), no other
weight_routers = {
    transport: APIRouter(dependencies=[Depends(require_token)])
    for transport in ("http", "collective", "disk")
}


@health_router.get("/health/")
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


@weight_routers["http"].post(WEIGHT_CHUNK_PATH)
async def update_weights(request: Request, query: Annotated[ChunkQuery, Query()]) -> ChunkResponse:
    # The body is streamed into the staging as it arrives (checked, hashed and copied once per piece on
    # the event loop: a memcpy and an XXH3 pass over at most a socket read), never gathered whole.
    sync = _http(request)
    try:
        receiver = await _weight_call(
            request,
            sync.begin_chunk,
            query.sync_id,
            query.chunk_index,
            query.digest,
            query.version,
            query.base_version,
        )
    except WeightSyncError:
        # Refused before its body was read (e.g. a delta against another base: 409). Drain the body (no copy)
        # so the answer goes out on a connection the client can keep using, never onto a half-read request.
        async for _ in request.stream():
            pass
        raise
    finished = False
    try:
        async for data in request.stream():
            receiver.feed(data)
        finished = True
    finally:
        if not finished:
            await _weight_call(request, sync.fail_chunk, receiver, "the chunk's body did not arrive whole")
    num = await _weight_call(request, sync.finish_chunk, receiver)
    return ChunkResponse(sync_id=query.sync_id, chunk_index=query.chunk_index, num_tensors=num)


@weight_routers["http"].post("/update_weights/commit/")
async def commit(body: CommitBody, request: Request) -> SyncResponse:
    return await _weight_call(request, _http(request).commit, body.sync_id, body.version, body.num_chunks)


@router.post("/update_weights/abort/")
async def abort(body: AbortBody, request: Request) -> dict[str, bool]:
    return {"aborted": await _weight_call(request, _service(request).sync.abort, body.sync_id)}


@weight_routers["collective"].post("/update_weights/group/init/")
async def group_init(body: GroupInitBody, request: Request) -> dict[str, int]:
    info = GroupInfo(body.master_address, body.master_port, body.rank, body.world_size, body.timeout_s)
    try:
        await _weight_call(request, _collective(request).group_init, info)
    except GroupError as exc:
        raise HTTPException(400, str(exc)) from None
    return {"rank": body.rank}


@weight_routers["collective"].post("/update_weights/group/start/")
async def group_start(body: GroupStartBody, request: Request) -> dict[str, str]:
    tensors = [(t.name, t.dtype, tuple(t.shape)) for t in body.tensors]
    await _weight_call(request, _collective(request).group_start, body.sync_id, body.version, tensors)
    return {"sync_id": body.sync_id}


@weight_routers["collective"].post("/update_weights/group/finish/")
async def group_finish(body: GroupFinishBody, request: Request) -> SyncResponse:
    return await _weight_call(request, _collective(request).group_finish, body.sync_id, body.version)


@weight_routers["disk"].post("/update_weights/from_disk/")
async def from_disk(body: DiskSyncBody, request: Request) -> SyncResponse:
    return await _weight_call(request, _disk(request).load_from_disk, body.path, body.version)


def _wrong_version(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=409)


def _too_many_requests(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=413)


def _bad_request(request: Request, exc: Exception) -> JSONResponse:
    status = status_of(exc) if isinstance(exc, WeightSyncError) else 400
    return JSONResponse({"detail": str(exc)}, status_code=status)


def _unprocessable(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    detail, errors = validation_detail(exc.errors())
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
            app.state.weight_executor.shutdown(wait=True)
            service.close()
            log.info(STOPPED_LINE)  # uvicorn runs at warning: this is the line that says shutdown finished

    app = FastAPI(title="stagectl rollout server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    app.state.weight_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="weight-sync")
    for routes in (health_router, swift_router, router):
        app.include_router(routes)
    for transport, receiver in (
        ("http", service.http),
        ("collective", service.collective),
        ("disk", service.disk),
    ):
        if receiver is not None:  # the configured transports' receivers and routes only
            app.include_router(weight_routers[transport])
    for error in (BadRequest, PathRefused, WeightSyncError, TooManyTokens):
        app.add_exception_handler(error, _bad_request)
    app.add_exception_handler(TooManyRequests, _too_many_requests)
    app.add_exception_handler(WrongVersion, _wrong_version)
    app.add_exception_handler(RequestValidationError, _unprocessable)
    settings = service.settings

    def limit_for(path: str) -> int:
        return settings.max_weight_chunk_bytes if path == WEIGHT_CHUNK_PATH else settings.max_request_bytes

    app.add_middleware(BodyLimit, limit_for=limit_for, body_timeout_s=settings.body_timeout_s)
    app.add_middleware(AccessLog)
    return app
