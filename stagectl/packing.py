"""Packing: which segments share a sequence, as pure bin packing over lengths (no torch).

`pack_segments` (best-fit decreasing: a fixed set of segments into the fewest packs),
`select_pack` and `PackBuffer` (one pack at a time from a bounded look-ahead buffer: the oldest item plus
the subset of the others that fills the pack best), `packing_lower_bound`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K")

# ---------------------------------------------------------------- pure bin packing


def pack_segments(lengths: Sequence[int], packing_length: int) -> list[list[int]]:
    """Group segment indices into packs of total length <= `packing_length` (best-fit decreasing).

    Deterministic: ties are broken by segment index. Indices inside a pack are ascending and packs are
    ordered by their first index. `ValueError` names the first segment that can never fit.
    """
    if packing_length <= 0:
        raise ValueError(f"packing_length must be positive, got {packing_length}")
    for index, length in enumerate(lengths):
        if length <= 0:
            raise ValueError(f"segment {index} has length {length}; lengths must be positive")
        if length > packing_length:
            raise ValueError(
                f"segment {index} has length {length} > packing_length {packing_length}; "
                "raise global_max_length or shorten the sample"
            )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    free: list[int] = []  # free[p] = room left in packs[p]
    for i in order:
        best = -1
        for p, room in enumerate(free):
            # Best fit: the fullest pack that still takes the segment (first such pack on ties).
            if lengths[i] <= room and (best < 0 or room < free[best]):
                best = p
        if best < 0:
            packs.append([i])
            free.append(packing_length - lengths[i])
        else:
            packs[best].append(i)
            free[best] -= lengths[i]
    return sorted((sorted(pack) for pack in packs), key=lambda pack: pack[0])


def select_pack(lengths: Sequence[int], capacity: int) -> list[int]:
    """One pack from a buffer of items (`lengths`, oldest first): the oldest item plus the subset of the
    others whose total comes closest to `capacity` without exceeding it (exact subset sum over the
    buffer, as a bitset of reachable totals; among equal totals the older items win). Returns buffer
    positions, ascending.

    Taking the oldest first means no item waits forever (never worse than FIFO); the exact subset sum
    fills the pack as far as the buffer allows. `ValueError` when the oldest item alone exceeds `capacity`.
    """
    if not lengths:
        return []
    if lengths[0] > capacity:
        raise ValueError(f"an item of length {lengths[0]} exceeds the pack capacity {capacity}")
    mask = (1 << (capacity + 1)) - 1
    reachable = [1 << lengths[0]]  # reachable[k]: totals reachable with item 0 and a subset of 1..k
    for length in lengths[1:]:
        reachable.append((reachable[-1] | (reachable[-1] << length)) & mask)
    target = reachable[-1].bit_length() - 1  # the fullest total that fits
    chosen = []
    for k in range(len(lengths) - 1, 0, -1):  # newest first: leave an item out whenever possible
        if not (reachable[k - 1] >> target) & 1:
            chosen.append(k)
            target -= lengths[k]
    return [0, *reversed(chosen)]


def pack_into(
    lengths: Sequence[int], num_packs: int, packing_length: int
) -> tuple[list[list[int]], list[int]]:
    """Spread segments over at most `num_packs` packs of at most `packing_length` tokens each. Returns the
    packs (indices ascending, empty packs left out, ordered by their first index) and the indices that fit
    nowhere.

    Where everything fits, as evenly as possible (largest first, each into the emptiest pack that takes
    it). Where it does not, that greedy spread can leave out far more than it must (two packs of 1024 and
    ten segments of 2096 tokens: it packed 1780 where 1947 fit), so the packs are then also filled one at
    a time, each with the fullest subset of the segments left (`select_pack`), and whichever of the two
    groupings packs more tokens is kept (the even one on a tie)."""
    even = _pack_evenly(lengths, num_packs, packing_length)
    if not even[1]:
        return even
    fullest = _pack_fullest_first(lengths, num_packs, packing_length)
    if _packed_tokens(lengths, fullest[0]) > _packed_tokens(lengths, even[0]):
        return fullest
    return even


def _packed_tokens(lengths: Sequence[int], groups: list[list[int]]) -> int:
    return sum(lengths[i] for group in groups for i in group)


def _pack_evenly(
    lengths: Sequence[int], num_packs: int, packing_length: int
) -> tuple[list[list[int]], list[int]]:
    """Largest first, each into the emptiest pack that takes it."""
    loads = [0] * num_packs
    groups: list[list[int]] = [[] for _ in range(num_packs)]
    left: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fitting = [p for p in range(num_packs) if loads[p] + lengths[i] <= packing_length]
        if not fitting:
            left.append(i)
            continue
        p = min(fitting, key=lambda p: (loads[p], p))
        loads[p] += lengths[i]
        groups[p].append(i)
    return sorted((sorted(g) for g in groups if g), key=lambda g: g[0]), sorted(left)


def _pack_fullest_first(
    lengths: Sequence[int], num_packs: int, packing_length: int
) -> tuple[list[list[int]], list[int]]:
    """One pack at a time, each the fullest subset of the segments left (the longest of them included)."""
    rest = sorted(
        (i for i in range(len(lengths)) if lengths[i] <= packing_length), key=lambda i: (-lengths[i], i)
    )
    groups: list[list[int]] = []
    for _ in range(num_packs):
        if not rest:
            break
        chosen = [rest[k] for k in select_pack([lengths[i] for i in rest], packing_length)]
        groups.append(sorted(chosen))
        taken = set(chosen)
        rest = [i for i in rest if i not in taken]
    packed = {i for group in groups for i in group}
    left = [i for i in range(len(lengths)) if i not in packed]
    return sorted(groups, key=lambda g: g[0]), left


@dataclass
class PackBuffer(Generic[K]):
    """A bounded FIFO of items waiting to be packed: `(key, length)` pairs, oldest first."""

    capacity_tokens: int  # packing_length
    items: list[tuple[K, int]] = field(default_factory=list)

    def add(self, key: K, length: int) -> None:
        if length > self.capacity_tokens:
            raise ValueError(f"an item of length {length} exceeds packing_length {self.capacity_tokens}")
        self.items.append((key, length))

    @property
    def num_tokens(self) -> int:
        return sum(length for _, length in self.items)

    def __len__(self) -> int:
        return len(self.items)

    def peek_fill(self) -> float:
        """The fill the next `pop_pack` would reach."""
        chosen = select_pack([length for _, length in self.items], self.capacity_tokens)
        return sum(self.items[i][1] for i in chosen) / self.capacity_tokens

    def pop_pack(self) -> list[tuple[K, int]]:
        """Remove and return the items of the next pack (`select_pack`), in buffer order."""
        chosen = select_pack([length for _, length in self.items], self.capacity_tokens)
        taken = set(chosen)
        pack = [self.items[i] for i in chosen]
        self.items = [item for i, item in enumerate(self.items) if i not in taken]
        return pack


def packing_lower_bound(lengths: Sequence[int], packing_length: int) -> int:
    """No packing uses fewer packs: `max(ceil(sum / L), #segments longer than L / 2)`."""
    total = sum(lengths)
    num_long = sum(1 for length in lengths if 2 * length > packing_length)
    return max(math.ceil(total / packing_length), num_long)
