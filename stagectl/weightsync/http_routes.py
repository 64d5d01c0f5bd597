"""The rollout server's routes of the `http` transport (`HttpReceiver`): the chunks of a sync, streamed into
the staging as they arrive, and the commit. The server mounts them when it accepts the transport, behind
its token check; the same chunks can also come over the weight-stream port (`stream`)."""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations, which name locals.
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from starlette.requests import ClientDisconnect

from stagectl.weightsync.errors import WeightSyncError
from stagectl.weightsync.http import HttpReceiver
from stagectl.weightsync.protocol import (
    WEIGHT_CHUNK_PATH,
    ChunkQuery,
    ChunkResponse,
    CommitBody,
    SyncResponse,
)

OffLoop = Callable[..., Awaitable[Any]]  # runs a blocking call on the app's weight executor


def routes(receiver: HttpReceiver, off_loop: OffLoop) -> APIRouter:
    router = APIRouter()

    @router.post(WEIGHT_CHUNK_PATH)
    async def update_weights(request: Request, query: Annotated[ChunkQuery, Query()]) -> ChunkResponse:
        # The body is streamed into the staging as it arrives (checked, hashed and copied once per piece on
        # the event loop: a memcpy and an XXH3 pass over at most a socket read), never gathered whole.
        try:
            chunk = await off_loop(
                receiver.begin_chunk,
                query.sync_id,
                query.chunk_index,
                query.digest,
                query.version,
                query.base_version,
            )
        except WeightSyncError:
            # Refused before its body was read (e.g. a delta against another base: 409). Drain the body (no
            # copy) so the answer goes out on a connection the client can keep using, never onto a half-read
            # request.
            async for _ in request.stream():
                pass
            raise
        finished = False
        try:
            async for data in request.stream():
                chunk.feed(data)
            finished = True
        except ClientDisconnect:  # the learner died or cut the sync mid-chunk: failed below, no traceback
            raise HTTPException(
                400, "the chunk's body did not arrive whole (the sender disconnected)"
            ) from None
        finally:
            if not finished:
                await off_loop(receiver.fail_chunk, chunk, "the chunk's body did not arrive whole")
        num = await off_loop(receiver.finish_chunk, chunk)
        return ChunkResponse(sync_id=query.sync_id, chunk_index=query.chunk_index, num_tensors=num)

    @router.post("/update_weights/commit/")
    async def commit(body: CommitBody) -> SyncResponse:
        result: SyncResponse = await off_loop(receiver.commit, body.sync_id, body.version, body.num_chunks)
        return result

    return router
