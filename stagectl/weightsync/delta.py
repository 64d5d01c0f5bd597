"""Delta sync, the learner's side: which elements changed since the last push, and how to send them.

`DeltaTracker` keeps a host copy of what it last pushed (one copy of the weights in CPU memory) and the
version that push created. `plan` compares the current state dict with it bit for bit (integer views:
-0.0 vs 0.0 and NaN payloads count as changes) and picks, per tensor, the cheaper encoding:

- unchanged: nothing;
- sparse: the flat indices (int32, or int64 past 2^31 elements) and new values of the changed elements,
  when that is smaller than the tensor;
- whole: the tensor (in row ranges when it is larger than one piece may be).

At RL learning rates most bf16 elements do not change at all between consecutive steps (their update is
below half an ulp), while almost every row block holds at least one that does, so element-level
sparsity is what makes a delta small; the server scatters the values into its staged copy of the base
version (see `sync.py`), so after any number of deltas it holds exactly what a full sync would have sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from stagectl.weightsync.wire import Piece, cpu_tensors, row_ranges

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class DeltaPlan:
    pieces: list[Piece]  # what to send
    wire_bytes: int  # tensor bytes of `pieces` (values + indices)
    total_bytes: int  # tensor bytes of the whole state dict
    # name -> flat indices of the changed elements (None: the whole tensor), for `DeltaTracker.pushed`
    changed: dict[str, torch.Tensor | None] = field(default_factory=dict)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A flat integer view of the tensor's bytes, for bitwise comparison."""
    return tensor.reshape(-1).view(_BITS[tensor.element_size()])


def bits_np(tensor: torch.Tensor) -> np.ndarray:
    """`bits` as a numpy array (no copy). The comparisons, gathers and scatters of a delta run in numpy:
    single-threaded and memory-bound, where torch's thread pool stalls badly on a busy host."""
    return bits(tensor).numpy()


class DeltaTracker:
    def __init__(self) -> None:
        self.ver: int | None = None  # the version the last successful push created; None: no base
        self._last: dict[str, torch.Tensor] = {}

    def plan(self, state: Mapping[str, torch.Tensor], max_piece_bytes: int) -> DeltaPlan:
        """The pieces that turn the last pushed state into `state`, none larger than `max_piece_bytes`
        (a single row may be)."""
        plan = DeltaPlan([], 0, 0)
        for name, tensor in cpu_tensors(state):
            nbytes = tensor.numel() * tensor.element_size()
            plan.total_bytes += nbytes
            old = self._last.get(name)
            if old is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
                self._add_whole(plan, name, tensor, max_piece_bytes)
                continue
            index = torch.from_numpy(np.flatnonzero(bits_np(tensor) != bits_np(old)))
            if index.numel() == 0:
                continue
            index_dtype = torch.int32 if tensor.numel() < 2**31 else torch.int64
            per_element = tensor.element_size() + index_dtype.itemsize
            if index.numel() * per_element >= nbytes:
                self._add_whole(plan, name, tensor, max_piece_bytes)
                continue
            plan.changed[name] = index
            values = torch.from_numpy(bits_np(tensor)[index.numpy()]).view(tensor.dtype)
            step = max(1, max_piece_bytes // per_element)
            for start in range(0, index.numel(), step):
                part = index[start : start + step].to(index_dtype)
                plan.pieces.append(Piece(name, None, values[start : start + step], index=part))
            plan.wire_bytes += index.numel() * per_element
        return plan

    def _add_whole(self, plan: DeltaPlan, name: str, tensor: torch.Tensor, max_piece_bytes: int) -> None:
        plan.changed[name] = None
        for span in row_ranges(tensor, max_piece_bytes):
            part = tensor if span is None else tensor[span[0] : span[1]]
            plan.pieces.append(Piece(name, span, part))
        plan.wire_bytes += tensor.numel() * tensor.element_size()

    def pushed(self, ver: int, state: Mapping[str, torch.Tensor], plan: DeltaPlan | None) -> None:
        """The servers now hold `state` as `ver`; `plan` is the delta that got it there (None: a full sync)."""
        for name, tensor in cpu_tensors(state):
            old = self._last.get(name)
            index = None if plan is None else plan.changed.get(name, False)
            if index is False:  # unchanged
                continue
            if old is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
                self._last[name] = tensor.clone()
            elif index is None:
                old.copy_(tensor)
            else:
                assert isinstance(index, torch.Tensor)
                positions = index.numpy()
                bits_np(old)[positions] = bits_np(tensor)[positions]
        self.ver = ver

    def reset(self) -> None:
        """Forget the base (a push failed): the next push is full."""
        self.ver = None
