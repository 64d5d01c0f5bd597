"""Weight-sync payloads: state dict -> bounded safetensors chunks (client) and chunk -> verified pieces
(server), plus the completeness check of a full sync.

A chunk is one safetensors blob of at most `chunk_bytes` of tensor data. A tensor larger than that is
split along dim 0 into row ranges; the blob's metadata key `stagectl.rows` maps such a tensor's name
to `[start, stop]` (JSON). Tensors are sent on CPU, contiguous, in their own dtype. No pickle.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from stagectl.rollout.protocol import TensorSpec

ROWS_KEY = "stagectl.rows"


class WeightSyncError(ValueError):
    """A sync was rejected (HTTP 400/409); the old weights keep serving."""


@dataclass(frozen=True)
class WeightChunk:
    index: int
    data: bytes  # a safetensors blob
    sha256: str  # hex digest of `data`
    num_tensors: int


@dataclass(frozen=True)
class Piece:
    name: str
    rows: tuple[int, int] | None  # [start, stop) along dim 0 when the tensor was split, else None
    tensor: torch.Tensor


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def spec_of(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(tensor.shape), dtype_name(tensor.dtype))


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_chunks(state: Mapping[str, torch.Tensor], chunk_bytes: int) -> Iterator[WeightChunk]:
    """Safetensors chunks of at most `chunk_bytes` tensor bytes each (lazily: one chunk in memory)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    index = 0
    batch: dict[str, torch.Tensor] = {}
    rows: dict[str, list[int]] = {}
    size = 0
    for name, tensor in _cpu_tensors(state):
        for span in _row_ranges(tensor, chunk_bytes):
            piece = tensor if span is None else tensor[span[0] : span[1]]
            nbytes = piece.numel() * piece.element_size()
            if batch and size + nbytes > chunk_bytes:
                yield _chunk(index, batch, rows)
                index, batch, rows, size = index + 1, {}, {}, 0
            batch[name] = piece.contiguous()
            if span is not None:
                rows[name] = list(span)
            size += nbytes
    if batch or index == 0:
        yield _chunk(index, batch, rows)


def _cpu_tensors(state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, tensor in state.items():
        t = tensor.detach().to("cpu")
        if t.data_ptr() in seen and t.numel() > 0:  # tied weights: safetensors refuses shared memory
            t = t.clone()
        seen.add(t.data_ptr())
        yield name, t


def _row_ranges(tensor: torch.Tensor, chunk_bytes: int) -> list[tuple[int, int] | None]:
    """[None] (send whole) or the [start, stop) row ranges of a tensor too large for one chunk."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes <= chunk_bytes or tensor.dim() == 0 or tensor.shape[0] <= 1:
        return [None]
    row_bytes = max(1, nbytes // tensor.shape[0])
    per_chunk = max(1, chunk_bytes // row_bytes)
    return [(s, min(s + per_chunk, tensor.shape[0])) for s in range(0, tensor.shape[0], per_chunk)]


def _chunk(index: int, batch: dict[str, torch.Tensor], rows: dict[str, list[int]]) -> WeightChunk:
    metadata = {ROWS_KEY: json.dumps(rows)} if rows else None
    data = st_save(batch, metadata=metadata)
    return WeightChunk(index=index, data=data, sha256=sha256_hex(data), num_tensors=len(batch))


def decode_chunk(data: bytes) -> list[Piece]:
    """The pieces of one chunk; `WeightSyncError` when it is not a valid safetensors blob."""
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
        if span is not None and not _is_row_span(span):
            raise WeightSyncError(f"chunk metadata {ROWS_KEY} for {name!r} must be [start, stop] integers")
        pieces.append(Piece(name, None if span is None else (span[0], span[1]), tensor))
    return pieces


def _is_row_span(span: object) -> bool:
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


class StagedWeights:
    """Accumulates pieces for one full sync and checks each against the model's specs as it arrives."""

    def __init__(self, specs: Mapping[str, TensorSpec]) -> None:
        self.specs = dict(specs)
        self.tensors: dict[str, torch.Tensor] = {}
        self._rows_seen: dict[str, torch.Tensor] = {}  # split tensors: (rows,) bool, True once received
        self.num_bytes = 0

    def add(self, piece: Piece) -> None:
        spec = self.specs.get(piece.name)
        if spec is None:
            raise WeightSyncError(f"unknown tensor {piece.name!r}: the serving model has no such weight")
        got = dtype_name(piece.tensor.dtype)
        if got != spec.dtype:
            raise WeightSyncError(f"{piece.name}: dtype {got}, the serving model has {spec.dtype}")
        if piece.rows is None:
            if piece.name in self.tensors:
                raise WeightSyncError(f"{piece.name}: sent twice in one sync")
            if tuple(piece.tensor.shape) != spec.shape:
                raise WeightSyncError(
                    f"{piece.name}: shape {list(piece.tensor.shape)}, the serving model has {list(spec.shape)}"
                )
            self.tensors[piece.name] = piece.tensor
        else:
            self._add_rows(piece, spec)
        self.num_bytes += piece.tensor.numel() * piece.tensor.element_size()

    def _add_rows(self, piece: Piece, spec: TensorSpec) -> None:
        assert piece.rows is not None
        start, stop = piece.rows
        expected = (stop - start, *spec.shape[1:])
        if (
            not spec.shape
            or not (0 <= start < stop <= spec.shape[0])
            or tuple(piece.tensor.shape) != expected
        ):
            raise WeightSyncError(
                f"{piece.name}: rows [{start}, {stop}) of shape {list(piece.tensor.shape)} do not fit "
                f"the serving model's {list(spec.shape)}"
            )
        full = self.tensors.get(piece.name)
        if full is None:
            full = self.tensors[piece.name] = torch.empty(spec.shape, dtype=piece.tensor.dtype)
            self._rows_seen[piece.name] = torch.zeros(spec.shape[0], dtype=torch.bool)
        seen = self._rows_seen.get(piece.name)
        if seen is None:
            raise WeightSyncError(f"{piece.name}: sent whole and in rows in one sync")
        if bool(seen[start:stop].any()):
            raise WeightSyncError(f"{piece.name}: rows [{start}, {stop}) overlap rows already sent")
        seen[start:stop] = True
        full[start:stop] = piece.tensor

    def check_complete(self) -> None:
        missing = [name for name in self.specs if name not in self.tensors]
        partial = [name for name, seen in self._rows_seen.items() if not bool(seen.all())]
        if missing or partial:
            shown = ", ".join((missing + partial)[:5])
            more = len(missing) + len(partial) - 5
            raise WeightSyncError(
                f"incomplete full sync: {len(missing)} tensors missing, {len(partial)} partially sent "
                f"({shown}{f', ... {more} more' if more > 0 else ''})"
            )


def verify_full(specs: Mapping[str, TensorSpec], tensors: Mapping[str, torch.Tensor]) -> int:
    """Check a whole state dict (a disk snapshot) against `specs`; returns its size in bytes."""
    staged = StagedWeights(specs)
    for name, tensor in tensors.items():
        staged.add(Piece(name, None, tensor))
    staged.check_complete()
    return staged.num_bytes
