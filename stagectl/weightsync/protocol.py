"""The wire contract of the rollout server's weight endpoints, shared by each transport's sender (`http`,
`collective`, `disk`) and the server's routes (`server.app`, and `stream` on the weight-stream port):

- `POST /update_weights/?sync_id=&chunk_index=&digest=&version=[&base_version=]` (`WEIGHT_CHUNK_PATH`,
  query `ChunkQuery`, answer `ChunkResponse`) with a raw safetensors body (one chunk,
  `application/octet-stream`, streamed; `digest` is its XXH3-128 in hex); chunks are sent in order 0, 1,
  2, ... A delta names `base_version`: a server not serving it answers 409.
- `POST /update_weights/commit/` with `CommitBody`; `POST /update_weights/abort/` with `AbortBody`.
- `POST /update_weights/from_disk/` with `DiskSyncBody` (a snapshot under an allowed directory).
- `POST /update_weights/group/{init,start,finish}/` with `GroupInitBody`, `GroupStartBody`,
  `GroupFinishBody` (`transport: collective`).

A sync that commits answers `SyncResponse`. Requests are strict (`extra="forbid"`: a typo is a 422 naming
the key), answers tolerate extra fields: the bases are `wire.protocol`'s, as are the inference side and
`GET /version/`. No pickle: JSON and safetensors only.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from stagectl.wire.protocol import WireRequest, WireResponse

WEIGHT_CHUNK_PATH = "/update_weights/"  # one weight chunk: POST, on the app port or the weight-stream port


class CommitBody(WireRequest):
    sync_id: str = Field(min_length=1, max_length=128)
    version: int = Field(ge=0)
    """Target version; must be above the serving version."""
    num_chunks: int = Field(ge=1)


class AbortBody(WireRequest):
    sync_id: str = Field(min_length=1, max_length=128)


class GroupInitBody(WireRequest):
    """`transport: collective`: join the learner's weight group (see `weightsync.collective`)."""

    master_address: str = Field(min_length=1, max_length=256)
    master_port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1)
    world_size: int = Field(ge=2)
    timeout_s: float = Field(gt=0, le=3600)


class GroupTensor(WireRequest):
    name: str = Field(min_length=1)
    dtype: str = Field(min_length=1, max_length=32)
    shape: list[int]


class GroupStartBody(WireRequest):
    """A collective sync: the tensors rank 0 is about to broadcast, in that order (checked against the
    model before a byte moves)."""

    sync_id: str = Field(min_length=1, max_length=128)
    version: int = Field(ge=0)
    tensors: list[GroupTensor] = Field(min_length=1)


class GroupFinishBody(WireRequest):
    sync_id: str = Field(min_length=1, max_length=128)
    version: int = Field(ge=0)


class DiskSyncBody(WireRequest):
    path: str
    """A `.safetensors` snapshot under one of the server's weight directories."""
    version: int = Field(ge=0)


DIGEST_PATTERN = r"^[0-9a-fA-F]{32}$"  # XXH3-128 of a weight chunk, hex


class ChunkQuery(BaseModel):
    """The query of `POST /update_weights/` (one weight chunk), checked by this one model on the app's port
    and on the weight-stream port alike (422 naming the field)."""

    sync_id: str = Field(min_length=1, max_length=128)
    chunk_index: int = Field(ge=0)
    digest: str = Field(pattern=DIGEST_PATTERN)
    version: int = Field(ge=0)
    base_version: int | None = Field(None, ge=0)  # a delta's base; absent for a full sync


class ChunkResponse(WireResponse):
    sync_id: str
    chunk_index: int
    num_tensors: int


class SyncResponse(WireResponse):
    version: int
    num_tensors: int
    num_bytes: int
    apply_s: float
    """Seconds the swap held the generation lock (0 when deferred)."""
    deferred: bool = False
    """Rollout calls were in progress: the swap waits for them (`weightsync.gate`), and every later untagged
    call is answered with this version."""
