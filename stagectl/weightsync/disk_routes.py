"""The rollout server's route of the `disk` transport (`DiskReceiver`): load a snapshot the learner wrote
under the server's weight directories. Mounted when the server accepts the transport, behind its token
check."""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations, which name locals.
from fastapi import APIRouter

from stagectl.weightsync.disk import DiskReceiver
from stagectl.weightsync.http_routes import OffLoop
from stagectl.weightsync.protocol import DiskSyncBody, SyncResponse


def routes(receiver: DiskReceiver, off_loop: OffLoop) -> APIRouter:
    router = APIRouter()

    @router.post("/update_weights/from_disk/")
    async def from_disk(body: DiskSyncBody) -> SyncResponse:
        result: SyncResponse = await off_loop(receiver.load_from_disk, body.path, body.version)
        return result

    return router
