"""Weight-sync payloads: bounded safetensors chunks, split tensors, and the staging checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stagectl.weightsync.disk import write_snapshot
from stagectl.weightsync.errors import WeightSyncError
from stagectl.weightsync.staging import StagedWeights, verify_full
from stagectl.weightsync.wire import Piece, TensorStream, decode_chunk, digest_hex, encode_chunks, spec_of


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(100, 16, generator=g),  # 6400 bytes: split when chunks are smaller
        "norm": torch.randn(16, generator=g),
        "scalar": torch.tensor(3.0),
        "half": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "ids": torch.arange(10),
    }


def _stage(state: dict[str, torch.Tensor], chunk_bytes: int) -> StagedWeights:
    staged = StagedWeights({name: spec_of(t) for name, t in state.items()}, {})
    for chunk in encode_chunks(state, chunk_bytes):
        assert chunk.digest == digest_hex(chunk.data)
        for piece in decode_chunk(chunk.data):
            staged.add(piece)
    staged.check_complete()
    return staged


@pytest.mark.parametrize("chunk_bytes", [1, 500, 1024, 4096, 1 << 20])
def test_round_trip_at_any_chunk_size(chunk_bytes: int) -> None:
    state = _state()
    staged = _stage(state, chunk_bytes)
    assert staged.tensors.keys() == state.keys()
    for name, tensor in state.items():
        assert staged.tensors[name].dtype == tensor.dtype
        assert torch.equal(staged.tensors[name], tensor), name


def test_chunks_respect_the_size_bound() -> None:
    state = _state()
    chunks = list(encode_chunks(state, 1024))
    for chunk in chunks:
        tensor_bytes = sum(p.tensor.numel() * p.tensor.element_size() for p in decode_chunk(chunk.data))
        assert tensor_bytes <= 1024
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert any(p.rows is not None for c in chunks for p in decode_chunk(c.data))  # "embed" was split
    assert len(list(encode_chunks(state, 1 << 20))) == 1


def test_empty_state_is_one_empty_chunk() -> None:
    chunks = list(encode_chunks({}, 1024))
    assert len(chunks) == 1 and decode_chunk(chunks[0].data) == []


def test_tied_tensors_are_sent() -> None:
    shared = torch.ones(4, 4)
    chunks = list(encode_chunks({"a": shared, "b": shared}, 1 << 20))
    assert {p.name for p in decode_chunk(chunks[0].data)} == {"a", "b"}


def _specs() -> StagedWeights:
    return StagedWeights({"w": spec_of(torch.zeros(4, 2)), "b": spec_of(torch.zeros(2))}, {})


@pytest.mark.parametrize(
    ("piece", "error"),
    [
        (Piece("nope", None, torch.zeros(2)), "unknown tensor 'nope'"),
        (Piece("w", None, torch.zeros(2, 4)), r"w: shape \[2, 4\], the serving model has \[4, 2\]"),
        (
            Piece("w", None, torch.zeros(4, 2, dtype=torch.float16)),
            "dtype float16, the serving model has float32",
        ),
        (Piece("w", (2, 6), torch.zeros(4, 2)), "do not fit"),
        (Piece("w", (0, 2), torch.zeros(3, 2)), "do not fit"),
    ],
)
def test_staging_rejects_mismatches(piece: Piece, error: str) -> None:
    with pytest.raises(WeightSyncError, match=error):
        _specs().add(piece)


def test_staging_rejects_duplicates_and_overlaps() -> None:
    staged = _specs()
    staged.add(Piece("b", None, torch.zeros(2)))
    with pytest.raises(WeightSyncError, match="sent twice"):
        staged.add(Piece("b", None, torch.zeros(2)))
    staged.add(Piece("w", (0, 2), torch.zeros(2, 2)))
    with pytest.raises(WeightSyncError, match="overlap"):
        staged.add(Piece("w", (1, 3), torch.zeros(2, 2)))
    with pytest.raises(WeightSyncError, match="sent twice"):
        staged.add(Piece("w", None, torch.zeros(4, 2)))


def test_incomplete_sync_names_what_is_missing() -> None:
    staged = _specs()
    staged.add(Piece("w", (0, 2), torch.zeros(2, 2)))
    with pytest.raises(WeightSyncError, match=r"1 tensors missing, 1 partially sent \(b, w\)"):
        staged.check_complete()
    staged.add(Piece("w", (2, 4), torch.ones(2, 2)))
    staged.add(Piece("b", None, torch.ones(2)))
    staged.check_complete()
    assert staged.tensors["w"][2:].eq(1).all() and staged.num_bytes == 4 * 2 * 4 + 2 * 4


def test_verify_full() -> None:
    specs = {"w": spec_of(torch.zeros(4, 2))}
    assert verify_full(specs, {"w": torch.ones(4, 2)}) == 32
    with pytest.raises(WeightSyncError, match="missing"):
        verify_full(specs, {})


@pytest.mark.parametrize("data", [b"", b"\x00" * 8, b"not safetensors at all", b"\xff" * 8 + b"{}"])
def test_garbage_chunk_is_rejected(data: bytes) -> None:
    with pytest.raises(WeightSyncError, match="not a valid safetensors chunk"):
        decode_chunk(data)


def _stream(state: dict[str, torch.Tensor]) -> TensorStream:
    return TensorStream({name: spec_of(t) for name, t in state.items()}, iter(list(state.items())))


@pytest.mark.parametrize("chunk_bytes", [500, 1 << 20])
def test_a_stream_encodes_to_the_same_chunks_as_its_state_dict(chunk_bytes: int) -> None:
    state = _state()
    whole = [(c.index, c.data, c.digest) for c in encode_chunks(state, chunk_bytes)]
    streamed = [(c.index, c.data, c.digest) for c in encode_chunks(_stream(state), chunk_bytes)]
    assert streamed == whole and len(whole) > (1 if chunk_bytes == 500 else 0)


def test_a_streamed_snapshot_is_the_same_file_as_the_state_dicts(tmp_path: Path) -> None:
    state = _state()
    assert write_snapshot(tmp_path / "a", state) == write_snapshot(tmp_path / "b", _stream(state))
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    assert _stream(state).num_bytes == sum(t.numel() * t.element_size() for t in state.values())


def test_a_stream_that_breaks_its_specs_is_refused() -> None:
    state = _state()
    specs = {name: spec_of(t) for name, t in state.items()}
    swapped = TensorStream(specs, iter([("norm", state["norm"]), ("embed", state["embed"])]))
    with pytest.raises(ValueError, match="announced 'embed'"):
        list(swapped.checked())
    short = TensorStream(specs, iter([("embed", state["embed"])]))
    with pytest.raises(ValueError, match="ended before 4 announced tensors"):
        list(short.checked())
    wrong_dtype = TensorStream(specs, iter([("embed", state["embed"].double())]))
    with pytest.raises(ValueError, match="float64"):
        list(wrong_dtype.checked())
