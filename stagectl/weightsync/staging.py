"""The server's side of a chunk: parse and check a safetensors header, reserve each piece in the sync's
staging, stream the body straight into the staging buffers (`ChunkReceiver`), and the completeness
check of a full sync or a delta. The sync's state machine around it: `receiver.WeightSync` and each
transport's receiver."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import xxhash

from stagectl.weightsync.delta import bits_np
from stagectl.weightsync.errors import WeightSyncError
from stagectl.weightsync.wire import (
    ELEMENT_SIZES,
    INDEX_SUFFIX,
    MAX_HEADER_BYTES,
    ROWS_KEY,
    SPARSE_KEY,
    ST_DTYPES,
    Piece,
    byte_view,
    is_row_span,
)
from stagectl.wire.protocol import TensorSpec, dtype_name


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    rows: tuple[int, int] | None
    start: int  # byte offsets in the data section
    stop: int


def parse_header(text: bytes) -> tuple[list[HeaderEntry], set[str]]:
    """The entries of a safetensors JSON header, checked for the shape of the format: known dtypes,
    sizes that match shapes, and data offsets that tile the data section in order with no gap; and the
    names sent sparse (values entry `name` + index entry `name@index`, `stagectl.sparse`)."""
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise WeightSyncError(f"not a valid safetensors chunk: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise WeightSyncError("not a valid safetensors chunk: header is not a mapping")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WeightSyncError("not a valid safetensors chunk: __metadata__ must map strings to strings")
    try:
        rows = json.loads(metadata.get(ROWS_KEY, "{}"))
    except (ValueError, RecursionError) as exc:
        raise WeightSyncError(f"chunk metadata {ROWS_KEY} is not JSON ({exc})") from None
    if not isinstance(rows, dict):
        raise WeightSyncError(f"chunk metadata {ROWS_KEY} must be a mapping of name -> [start, stop]")
    try:
        sparse = json.loads(metadata.get(SPARSE_KEY, "[]"))
    except (ValueError, RecursionError) as exc:
        raise WeightSyncError(f"chunk metadata {SPARSE_KEY} is not JSON ({exc})") from None
    if not isinstance(sparse, list) or not all(isinstance(n, str) and n not in rows for n in sparse):
        raise WeightSyncError(f"chunk metadata {SPARSE_KEY} must be a list of names not sent in rows")
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise WeightSyncError(f"not a valid safetensors chunk: bad header entry for {name!r}")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if code not in ST_DTYPES:
            raise WeightSyncError(f"not a valid safetensors chunk: {name!r} has unknown dtype {code!r}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise WeightSyncError(f"not a valid safetensors chunk: {name!r} has a bad shape {shape!r}")
        if not is_row_span(offsets) or offsets[0] > offsets[1]:
            raise WeightSyncError(f"not a valid safetensors chunk: {name!r} has bad data_offsets {offsets!r}")
        count = 1
        for d in shape:
            count *= d
        if count * ELEMENT_SIZES[code] != offsets[1] - offsets[0]:
            raise WeightSyncError(f"not a valid safetensors chunk: {name!r} size does not match its shape")
        span = rows.get(name)
        if span is not None and not is_row_span(span):
            raise WeightSyncError(f"chunk metadata {ROWS_KEY} for {name!r} must be [start, stop] integers")
        entries.append(
            HeaderEntry(
                name, ST_DTYPES[code], tuple(shape), None if span is None else (span[0], span[1]), *offsets
            )
        )
    entries.sort(key=lambda e: (e.start, e.stop))
    position = 0
    for e in entries:
        if e.start != position:
            raise WeightSyncError("not a valid safetensors chunk: data offsets leave a gap or overlap")
        position = e.stop
    return entries, set(sparse)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**62


class StagedWeights:
    """One sync's staging: pieces land in `buffers` (the server's persistent copy of the weights), each
    checked against the model's specs when its header arrives. A full sync must cover every tensor; a
    delta covers any subset (the rest of a touched tensor's rows keep the serving values)."""

    def __init__(
        self, specs: Mapping[str, TensorSpec], buffers: dict[str, torch.Tensor], *, delta: bool = False
    ) -> None:
        self.specs = dict(specs)
        self.buffers = buffers
        self.delta = delta
        self.names: set[str] = set()  # tensors touched by this sync
        self._rows_seen: dict[str, torch.Tensor] = {}  # row-sent tensors: (rows,) bool, True once received
        self._sparse: set[str] = set()  # tensors sent as sparse values (a delta)
        self.num_bytes = 0

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The touched tensors (whole), to hand to `Engine.apply_weights`."""
        return {name: self.buffers[name] for name in self.specs if name in self.names}

    def reserve(
        self, name: str, rows: tuple[int, int] | None, dtype: str, shape: tuple[int, ...]
    ) -> memoryview:
        """Check one piece against the specs and what this sync already received; returns the bytes of
        the staging buffer it must be written to."""
        spec = self.specs.get(name)
        if spec is None:
            raise WeightSyncError(f"unknown tensor {name!r}: the serving model has no such weight")
        if dtype != spec.dtype:
            raise WeightSyncError(f"{name}: dtype {dtype}, the serving model has {spec.dtype}")
        buffer = self.buffers.get(name)
        if buffer is None:
            buffer = self.buffers[name] = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
        if name in self._sparse:
            raise WeightSyncError(f"{name}: sent sparse and whole or in rows in one sync")
        if rows is None:
            if name in self.names:
                raise WeightSyncError(f"{name}: sent twice in one sync")
            if shape != spec.shape:
                raise WeightSyncError(
                    f"{name}: shape {list(shape)}, the serving model has {list(spec.shape)}"
                )
            self.names.add(name)
            self.num_bytes += buffer.numel() * buffer.element_size()
            return byte_view(buffer)
        start, stop = rows
        if (
            not spec.shape
            or not (0 <= start < stop <= spec.shape[0])
            or shape != (stop - start, *spec.shape[1:])
        ):
            raise WeightSyncError(
                f"{name}: rows [{start}, {stop}) of shape {list(shape)} do not fit "
                f"the serving model's {list(spec.shape)}"
            )
        seen = self._rows_seen.get(name)
        if seen is None:
            if name in self.names:
                raise WeightSyncError(f"{name}: sent whole and in rows in one sync")
            seen = self._rows_seen[name] = torch.zeros(spec.shape[0], dtype=torch.bool)
            self.names.add(name)
        if bool(seen[start:stop].any()):
            raise WeightSyncError(f"{name}: rows [{start}, {stop}) overlap rows already sent")
        seen[start:stop] = True
        part = buffer[start:stop]
        self.num_bytes += part.numel() * part.element_size()
        return byte_view(part)

    def reserve_sparse(
        self, name: str, count: int, dtype: str, index_dtype: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers for `count` new values of `name` and their flat positions (a delta only)."""
        spec = self.specs.get(name)
        if spec is None:
            raise WeightSyncError(f"unknown tensor {name!r}: the serving model has no such weight")
        if not self.delta:
            raise WeightSyncError(f"{name}: sent sparse in a full sync (sparse pieces are for deltas)")
        if dtype != spec.dtype:
            raise WeightSyncError(f"{name}: dtype {dtype}, the serving model has {spec.dtype}")
        if name in self.names and name not in self._sparse:
            raise WeightSyncError(f"{name}: sent sparse and whole or in rows in one sync")
        if count > spec.num_elements:
            raise WeightSyncError(f"{name}: {count} sparse values for {spec.num_elements} elements")
        self.names.add(name)
        self._sparse.add(name)
        values = torch.empty(count, dtype=getattr(torch, dtype))
        self.num_bytes += values.numel() * values.element_size()
        return values, torch.empty(count, dtype=getattr(torch, index_dtype))

    def scatter(self, name: str, values: torch.Tensor, index: torch.Tensor) -> None:
        """Write verified sparse values into the staged copy of the base version."""
        buffer = self.buffers.get(name)
        if buffer is None:
            raise WeightSyncError(f"{name}: a sparse delta needs the staged base, which is not there")
        positions = index.numpy()
        numel = buffer.numel()
        if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= numel):
            raise WeightSyncError(f"{name}: sparse index outside [0, {numel})")
        bits_np(buffer)[positions] = bits_np(values)  # numpy: see `delta.bits_np`

    def add(self, piece: Piece) -> None:
        """Stage a decoded piece (a copy into the staging buffer)."""
        t = piece.tensor.contiguous()
        destination = self.reserve(piece.name, piece.rows, dtype_name(t.dtype), tuple(t.shape))
        destination[:] = byte_view(t)

    def check_complete(self) -> None:
        missing = [] if self.delta else [name for name in self.specs if name not in self.names]
        partial = [] if self.delta else [n for n, seen in self._rows_seen.items() if not bool(seen.all())]
        if missing or partial:
            shown = ", ".join((missing + partial)[:5])
            more = len(missing) + len(partial) - 5
            raise WeightSyncError(
                f"incomplete full sync: {len(missing)} tensors missing, {len(partial)} partially sent "
                f"({shown}{f', ... {more} more' if more > 0 else ''})"
            )


class ChunkReceiver:
    """Streams one chunk into a `StagedWeights`: `feed` the body in pieces of any size, then `finish`.

    The 8-byte length and the JSON header are collected first and checked (every entry reserved in the
    staging); then each body byte is copied once, straight to its staging buffer, and hashed. `finish`
    checks the length and the digest. The first error is kept and raised by `finish` (the rest of the
    body is still drained, so the HTTP connection stays usable)."""

    def __init__(self, staged: StagedWeights, digest: str) -> None:
        self.staged = staged
        self.expected_digest = digest.lower()
        self._hash = xxhash.xxh3_128()
        self._prefix = bytearray()  # the header, until it is complete
        self._targets: list[tuple[int, int, memoryview]] | None = None  # (start, stop, destination)
        self._target = 0
        self._position = 0  # bytes of the data section received
        self._data_bytes = 0
        self.num_tensors = 0
        self._sparse: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, values, index) to scatter
        self.error: WeightSyncError | None = None

    def feed(self, data: bytes | memoryview) -> None:
        if self.error is not None or not data:
            return
        try:
            self._feed(memoryview(data).cast("B"))
        except WeightSyncError as exc:
            self.error = exc.with_traceback(None)  # its frames hold views of the body (maybe an mmap)

    def abandon(self) -> None:
        """Its sync failed while it streamed (`receiver.Writer`): nothing to drop but the buffers, which the
        sync gives up; bytes still arriving land in them and go with them (`finish_chunk` refuses it)."""

    def destination(self) -> memoryview | None:
        """Where the next body bytes belong in the staging (a writable view of the rest of the current
        tensor), so a socket can `readinto` it and skip `feed`'s copy; then call `received(n)`. None while
        the header is still arriving, after an error, or past the last tensor: use `feed`."""
        if self.error is not None or self._targets is None or self._target >= len(self._targets):
            return None
        start, stop, destination = self._targets[self._target]
        if self._position < start:
            return None
        return destination[self._position - start : stop - start]

    def received(self, n: int) -> None:
        """`n` bytes were written at the start of `destination()`: hash them and move on."""
        assert self._targets is not None
        start, stop, destination = self._targets[self._target]
        offset = self._position - start
        self._hash.update(destination[offset : offset + n])
        self._position += n
        if self._position == stop:
            self._target += 1

    def _feed(self, view: memoryview) -> None:
        self._hash.update(view)
        if self._targets is None:
            view = self._read_header(view)
            if self._targets is None:
                return
        while view.nbytes:
            if self._target >= len(self._targets):
                raise WeightSyncError(
                    f"chunk is longer than its header declares ({self._data_bytes} data bytes)"
                )
            start, stop, destination = self._targets[self._target]
            take = min(view.nbytes, stop - self._position)
            offset = self._position - start
            destination[offset : offset + take] = view[:take]
            self._position += take
            view = view[take:]
            if self._position == stop:
                self._target += 1

    def _read_header(self, view: memoryview) -> memoryview:
        if len(self._prefix) < 8:
            take = min(view.nbytes, 8 - len(self._prefix))
            self._prefix += view[:take]
            view = view[take:]
            if len(self._prefix) < 8:
                return view
        (header_len,) = struct.unpack("<Q", self._prefix[:8])
        if header_len > MAX_HEADER_BYTES:
            raise WeightSyncError(f"not a valid safetensors chunk: header of {header_len} bytes")
        need = 8 + header_len
        take = min(view.nbytes, need - len(self._prefix))
        self._prefix += view[:take]
        view = view[take:]
        if len(self._prefix) < need:
            return view
        entries, sparse = parse_header(bytes(self._prefix[8:]))
        by_name = {e.name: e for e in entries}
        self._targets = []
        for e in entries:
            if e.name.endswith(INDEX_SUFFIX) and e.name.removesuffix(INDEX_SUFFIX) in sparse:
                continue  # reserved with its values below
            if e.name in sparse:
                values, index = self._reserve_sparse(e, by_name.get(e.name + INDEX_SUFFIX))
                self._sparse.append((e.name, values, index))
                destinations = [(e, byte_view(values)), (by_name[e.name + INDEX_SUFFIX], byte_view(index))]
            else:
                destinations = [(e, self.staged.reserve(e.name, e.rows, e.dtype, e.shape))]
            for entry, destination in destinations:
                if entry.stop > entry.start:
                    self._targets.append((entry.start, entry.stop, destination))
        self._targets.sort(key=lambda t: t[0])
        self._data_bytes = entries[-1].stop if entries else 0
        self.num_tensors = len(entries) - len(sparse)
        return view

    def _reserve_sparse(
        self, values: HeaderEntry, index: HeaderEntry | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if index is None or index.dtype not in ("int32", "int64"):
            raise WeightSyncError(
                f"{values.name}: sent sparse without an int32/int64 {values.name}{INDEX_SUFFIX}"
            )
        if len(values.shape) != 1 or index.shape != values.shape:
            raise WeightSyncError(
                f"{values.name}: sparse values {list(values.shape)} and index {list(index.shape)} must be "
                "1-D of one length"
            )
        return self.staged.reserve_sparse(values.name, values.shape[0], values.dtype, index.dtype)

    def finish(self) -> int:
        """Raise on any problem with the chunk; the number of tensors in it otherwise."""
        if self.error is not None:
            raise self.error
        if self._targets is None:
            raise WeightSyncError(
                f"not a valid safetensors chunk: truncated header ({len(self._prefix)} bytes)"
            )
        if self._position != self._data_bytes:
            raise WeightSyncError(
                f"truncated chunk: {self._position} of {self._data_bytes} data bytes arrived"
            )
        actual = self._hash.hexdigest()
        if actual != self.expected_digest:
            raise WeightSyncError(f"checksum mismatch (header {self.expected_digest}, body {actual})")
        for name, values, index in self._sparse:  # verified: now they may touch the staged base
            self.staged.scatter(name, values, index)
        return self.num_tensors


def verify_full(specs: Mapping[str, TensorSpec], tensors: Mapping[str, torch.Tensor]) -> int:
    """Check a whole state dict (a disk snapshot) against `specs`; returns its size in bytes."""
    missing = [name for name in specs if name not in tensors]
    num_bytes = 0
    for name, tensor in tensors.items():
        spec = specs.get(name)
        if spec is None:
            raise WeightSyncError(f"unknown tensor {name!r}: the serving model has no such weight")
        if dtype_name(tensor.dtype) != spec.dtype:
            raise WeightSyncError(
                f"{name}: dtype {dtype_name(tensor.dtype)}, the serving model has {spec.dtype}"
            )
        if tuple(tensor.shape) != spec.shape:
            raise WeightSyncError(
                f"{name}: shape {list(tensor.shape)}, the serving model has {list(spec.shape)}"
            )
        num_bytes += tensor.numel() * tensor.element_size()
    if missing:
        more = len(missing) - 5
        raise WeightSyncError(
            f"incomplete full sync: {len(missing)} tensors missing, 0 partially sent "
            f"({', '.join(missing[:5])}{f', ... {more} more' if more > 0 else ''})"
        )
    return num_bytes
