"""The rollout server's routes of the `collective` transport (`GroupReceiver`): joining the weight group,
then the start and finish of each sync whose tensors arrive by broadcast. Mounted when the server accepts
the transport, behind its token check."""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations, which name locals.
from fastapi import APIRouter, HTTPException

from stagectl.weightsync.collective import GroupError, GroupInfo, GroupReceiver
from stagectl.weightsync.http_routes import OffLoop
from stagectl.weightsync.protocol import GroupFinishBody, GroupInitBody, GroupStartBody, SyncResponse


def routes(receiver: GroupReceiver, off_loop: OffLoop) -> APIRouter:
    router = APIRouter()

    @router.post("/update_weights/group/init/")
    async def group_init(body: GroupInitBody) -> dict[str, int]:
        info = GroupInfo(body.master_address, body.master_port, body.rank, body.world_size, body.timeout_s)
        try:
            await off_loop(receiver.group_init, info)
        except GroupError as exc:
            raise HTTPException(400, str(exc)) from None
        return {"rank": body.rank}

    @router.post("/update_weights/group/start/")
    async def group_start(body: GroupStartBody) -> dict[str, str]:
        tensors = [(t.name, t.dtype, tuple(t.shape)) for t in body.tensors]
        await off_loop(receiver.group_start, body.sync_id, body.version, tensors)
        return {"sync_id": body.sync_id}

    @router.post("/update_weights/group/finish/")
    async def group_finish(body: GroupFinishBody) -> SyncResponse:
        result: SyncResponse = await off_loop(receiver.group_finish, body.sync_id, body.version)
        return result

    return router
