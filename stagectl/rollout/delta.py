"""Delta sync, the learner's side: what changed since the last push, in row blocks.

`DeltaTracker` keeps one XXH3-64 digest per row block of every tensor it last pushed (not a copy of the
weights: 8 bytes per block) and the version that push created. `plan` hashes the current state dict
(~28 GB/s) and returns the pieces whose bytes changed: whole tensors where every block changed, merged
row ranges otherwise. A block is `block_bytes` of whole rows along dim 0 (a tensor with one row or none
is one block). The server applies the pieces over the weights it serves (the base version) — see
`sync.py` — so after any number of deltas it holds exactly what a full sync would have sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import xxhash

from stagectl.rollout.weights import Piece, byte_view, cpu_tensors


@dataclass(frozen=True)
class DeltaPlan:
    pieces: list[Piece]  # what to send
    digests: dict[str, list[int]]  # every tensor's block digests after this push
    changed_bytes: int
    total_bytes: int


def block_rows(tensor: torch.Tensor, block_bytes: int) -> int:
    """Rows per block (the whole tensor when it has at most one row)."""
    if tensor.dim() == 0 or tensor.shape[0] <= 1 or tensor.numel() == 0:
        return max(1, tensor.shape[0] if tensor.dim() else 1)
    row_bytes = max(1, tensor.numel() * tensor.element_size() // tensor.shape[0])
    return max(1, block_bytes // row_bytes)


def block_digests(tensor: torch.Tensor, block_bytes: int) -> list[int]:
    view = byte_view(tensor)
    if tensor.dim() == 0 or tensor.shape[0] <= 1 or view.nbytes == 0:
        return [xxhash.xxh3_64_intdigest(view)]
    step = block_rows(tensor, block_bytes) * (view.nbytes // tensor.shape[0])
    return [xxhash.xxh3_64_intdigest(view[s : s + step]) for s in range(0, view.nbytes, step)]


class DeltaTracker:
    def __init__(self, block_bytes: int) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        self.block_bytes = block_bytes
        self.ver: int | None = None  # the version the last successful push created; None: no base
        self._digests: dict[str, list[int]] = {}

    def plan(self, state: Mapping[str, torch.Tensor]) -> DeltaPlan:
        pieces: list[Piece] = []
        digests: dict[str, list[int]] = {}
        changed = total = 0
        for name, tensor in cpu_tensors(state):
            nbytes = tensor.numel() * tensor.element_size()
            total += nbytes
            new = digests[name] = block_digests(tensor, self.block_bytes)
            old = self._digests.get(name)
            if old is None or len(old) != len(new):
                flags = [True] * len(new)
            else:
                flags = [a != b for a, b in zip(old, new, strict=True)]
            if all(flags):
                pieces.append(Piece(name, None, tensor))
                changed += nbytes
                continue
            rows = block_rows(tensor, self.block_bytes)
            for first, last in _runs(flags):
                start, stop = first * rows, min((last + 1) * rows, tensor.shape[0])
                part = tensor[start:stop]
                pieces.append(Piece(name, (start, stop), part))
                changed += part.numel() * part.element_size()
        return DeltaPlan(pieces, digests, changed, total)

    def pushed(self, ver: int, plan: DeltaPlan) -> None:
        """The servers now hold `plan`'s state as `ver`."""
        self.ver = ver
        self._digests = plan.digests

    def reset(self) -> None:
        """Forget the base (a push failed or went elsewhere): the next push is full."""
        self.ver = None
        self._digests = {}


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """[first, last] index pairs of the maximal runs of True."""
    runs = []
    start = None
    for i, flag in enumerate(flags):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i - 1))
            start = None
    if start is not None:
        runs.append((start, len(flags) - 1))
    return runs
