"""Weight-sync payloads: state dict -> bounded safetensors chunks (client), chunk bytes -> staging
(server), the completeness check of a sync, and the checksum.

A chunk is one safetensors blob of at most `chunk_bytes` of tensor data. A tensor larger than that is sent
as row ranges along dim 0; the blob's metadata key `stagectl.rows` maps such a tensor's name to
`[start, stop]` (JSON). A delta may send a tensor sparse: its new values under its name and their flat
positions under `<name>@index`, listed in `stagectl.sparse`. Tensors are sent on CPU, contiguous, in their own
dtype. No pickle.

Zero copies on the client: a chunk is its safetensors header plus memoryviews of the tensors' own bytes
(`WeightChunk.views`), hashed and written to the socket or file as they are. The server streams a chunk
(`ChunkReceiver`): it parses and checks the header from the first bytes, then copies every arriving
piece of the body straight into its staging buffer, hashing on the way; the digest is compared at the
end of the chunk, and any mismatch fails the whole sync.

Checksum: XXH3-128 (`digest_hex`), not sha256, whose speed would cap every sync (docs/weight_sync.md).
Its job is integrity against corruption (a truncated or garbled chunk or file), not authenticity: the
weight endpoints are bearer-token authenticated and loopback by default, and anyone holding the token
can push any weights anyway, so a cryptographic hash would buy nothing.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from stagectl.weightsync.errors import WeightSyncError
from stagectl.wire.protocol import TensorSpec, spec_of

ROWS_KEY = "stagectl.rows"
SPARSE_KEY = "stagectl.sparse"  # JSON list of names sent as values + `<name>@index` (delta only)
INDEX_SUFFIX = "@index"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own cap
# torch dtype name -> safetensors dtype code
ST_CODES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
ST_DTYPES = {code: name for name, code in ST_CODES.items()}
ELEMENT_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}
ELEMENT_SIZES |= {"BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class WeightChunk:
    index: int
    header: bytes  # the safetensors prefix: 8-byte little-endian length + JSON header
    views: tuple[memoryview, ...]  # the tensors' own bytes, in data order (no copy)
    digest: str  # XXH3-128 hex of header + views
    num_tensors: int

    @property
    def num_bytes(self) -> int:
        return len(self.header) + sum(v.nbytes for v in self.views)

    @property
    def data(self) -> bytes:
        """The whole blob as one bytes object (a copy; for tests and small payloads)."""
        return b"".join([self.header, *self.views])

    def parts(self, max_bytes: int = 1 << 20) -> Iterator[memoryview]:
        """The blob as memoryviews of at most `max_bytes` (what goes on the wire; no copy)."""
        yield memoryview(self.header)
        for view in self.views:
            for start in range(0, view.nbytes, max_bytes):
                yield view[start : start + max_bytes]


@dataclass(frozen=True)
class Piece:
    name: str
    rows: tuple[int, int] | None  # [start, stop) along dim 0 when the tensor was split, else None
    tensor: torch.Tensor  # a sparse piece: the new values, 1-D
    index: torch.Tensor | None = None  # a sparse piece (delta only): flat positions of `tensor`'s values

    @property
    def num_bytes(self) -> int:
        extra = 0 if self.index is None else self.index.numel() * self.index.element_size()
        return self.tensor.numel() * self.tensor.element_size() + extra


@dataclass
class TensorStream:
    """A state dict that arrives one tensor at a time (e.g. gathered from FSDP shards, `learner.weight_stream`):
    `specs` names every tensor with its shape and dtype up front, in the order `tensors` yields them. A
    consumer sends each tensor and lets it go before it takes the next, so what it holds at once is bounded
    by a tensor (or a chunk), not by the model. Taking the next tensor may be a collective: a consumer
    takes them in order from one thread at a time."""

    specs: dict[str, TensorSpec]
    tensors: Iterator[tuple[str, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(spec_num_bytes(spec) for spec in self.specs.values())

    def checked(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors as CPU contiguous tensors, each checked against its spec, in the specs' order."""
        expected = iter(self.specs.items())
        for name, tensor in self.tensors:
            want_name, want = next(expected, (None, None))
            if name != want_name or want is None or spec_of(tensor) != want:
                raise ValueError(
                    f"weight stream: got {name!r} {spec_of(tensor)}, its specs announced {want_name!r} {want}"
                )
            yield name, tensor.detach().to("cpu").contiguous()
        missing = [name for name, _ in expected]
        if missing:
            raise ValueError(
                f"weight stream ended before {len(missing)} announced tensors, e.g. {missing[0]!r}"
            )


WeightState = Mapping[str, torch.Tensor] | TensorStream  # what a push takes


def spec_num_bytes(spec: TensorSpec) -> int:
    return spec.num_elements * ELEMENT_SIZES[ST_CODES[spec.dtype]]


def digest_hex(*buffers: bytes | memoryview) -> str:
    """XXH3-128 of the buffers in order, as 32 hex characters."""
    h = xxhash.xxh3_128()
    for buffer in buffers:
        h.update(buffer)
    return h.hexdigest()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the view keeps the tensor alive)."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def cpu_tensors(state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, contiguous CPU tensor); tied weights are cloned so every name owns its bytes."""
    seen: set[int] = set()
    for name, tensor in state.items():
        t = tensor.detach().to("cpu").contiguous()
        if t.data_ptr() in seen and t.numel() > 0:
            t = t.clone()
        seen.add(t.data_ptr())
        yield name, t


def full_pieces(state: WeightState, chunk_bytes: int) -> Iterator[Piece]:
    """Every tensor, split into row ranges where it is larger than `chunk_bytes` (a stream's tensors one
    at a time, as they arrive)."""
    tensors = state.checked() if isinstance(state, TensorStream) else cpu_tensors(state)
    for name, tensor in tensors:
        for span in row_ranges(tensor, chunk_bytes):
            piece = tensor if span is None else tensor[span[0] : span[1]]
            yield Piece(name, span, piece)


def encode_chunks(state: WeightState, chunk_bytes: int) -> Iterator[WeightChunk]:
    """Safetensors chunks of at most `chunk_bytes` tensor bytes each (lazily; views, not copies)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    return encode_pieces(full_pieces(state, chunk_bytes), chunk_bytes)


def encode_pieces(pieces: Iterable[Piece], chunk_bytes: int) -> Iterator[WeightChunk]:
    """Pack pieces into chunks of at most `chunk_bytes` tensor bytes (a single larger piece gets its
    own chunk); a second piece of one name starts a new chunk (names are unique within a blob)."""
    index = 0
    batch: list[Piece] = []
    size = 0
    for piece in pieces:
        nbytes = piece.num_bytes
        if batch and (size + nbytes > chunk_bytes or any(p.name == piece.name for p in batch)):
            yield _chunk(index, batch)
            index, batch, size = index + 1, [], 0
        batch.append(piece)
        size += nbytes
    if batch or index == 0:
        yield _chunk(index, batch)


def row_ranges(tensor: torch.Tensor, chunk_bytes: int) -> list[tuple[int, int] | None]:
    """[None] (send whole) or the [start, stop) row ranges of a tensor too large for one chunk."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes <= chunk_bytes or tensor.dim() == 0 or tensor.shape[0] <= 1:
        return [None]
    row_bytes = max(1, nbytes // tensor.shape[0])
    per_chunk = max(1, chunk_bytes // row_bytes)
    return [(s, min(s + per_chunk, tensor.shape[0])) for s in range(0, tensor.shape[0], per_chunk)]


def _chunk(index: int, pieces: list[Piece]) -> WeightChunk:
    metadata = {}
    rows = {p.name: list(p.rows) for p in pieces if p.rows is not None}
    if rows:
        metadata[ROWS_KEY] = json.dumps(rows)
    sparse = [p.name for p in pieces if p.index is not None]
    if sparse:
        metadata[SPARSE_KEY] = json.dumps(sparse)
    entries = []
    for p in pieces:
        entries.append((p.name, p.tensor.contiguous()))
        if p.index is not None:
            entries.append((p.name + INDEX_SUFFIX, p.index.contiguous()))
    views = [byte_view(tensor) for _, tensor in entries]
    prefix = safetensors_prefix([(name, spec_of(tensor)) for name, tensor in entries], metadata)
    return WeightChunk(
        index=index,
        header=prefix,
        views=tuple(views),
        digest=digest_hex(prefix, *views),
        num_tensors=len(pieces),
    )


def safetensors_prefix(entries: Iterable[tuple[str, TensorSpec]], metadata: Mapping[str, str]) -> bytes:
    """The 8-byte length + JSON header of a safetensors blob holding `entries` back to back, in order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, spec in entries:
        code = ST_CODES.get(spec.dtype)
        if code is None:
            raise ValueError(f"{name}: dtype {spec.dtype} cannot be sent in a weight sync")
        nbytes = spec.num_elements * ELEMENT_SIZES[code]
        header[name] = {"dtype": code, "shape": list(spec.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8-byte alignment
    return struct.pack("<Q", len(text)) + text


def decode_chunk(data: bytes) -> list[Piece]:
    """The pieces of one whole chunk, read by the safetensors library (the reference decoder: tests check
    that `encode_chunks` writes real safetensors); `WeightSyncError` when it is not a valid blob."""
    try:
        tensors = st_load(data)
        metadata = _metadata(data)
        rows = json.loads(metadata.get(ROWS_KEY, "{}"))
    except (SafetensorError, ValueError, struct.error, RecursionError) as exc:
        raise WeightSyncError(f"not a valid safetensors chunk: {exc}") from None
    if not isinstance(rows, dict):
        raise WeightSyncError(f"chunk metadata {ROWS_KEY} must be a mapping of name -> [start, stop]")
    pieces = []
    for name, tensor in tensors.items():
        span = rows.get(name)
        if span is not None and not is_row_span(span):
            raise WeightSyncError(f"chunk metadata {ROWS_KEY} for {name!r} must be [start, stop] integers")
        pieces.append(Piece(name, None if span is None else (span[0], span[1]), tensor))
    return pieces


def is_row_span(span: object) -> bool:
    return (
        isinstance(span, list)
        and len(span) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 for v in span)
    )


def _metadata(data: bytes) -> dict[str, str]:
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("__metadata__ must be a mapping")
    return metadata
