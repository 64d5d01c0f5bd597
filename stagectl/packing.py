"""Packing: which segments share a sequence (pure bin packing) and how a pack becomes one micro-batch.

Pure part: `pack_segments` (best-fit decreasing: a fixed set of segments into the fewest packs),
`select_pack` and `PackBuffer` (one pack at a time from a bounded look-ahead buffer: the oldest item plus
the subset of the others that fills the pack best), `packing_lower_bound`.

Collator: `collate_pack` concatenates segments into ONE batch-size-1 sequence that the model reads
exactly as it would read each segment alone:
- `position_ids` has shape (4, 1, L): row 0 is the text position restarting at 0 in every segment,
  rows 1..3 the multimodal rotary (t, h, w) positions, computed per segment by the model's own
  `get_rope_index`. Transformers' Qwen-VL text models split row 0 off and pass it to
  `create_causal_mask`, which (with `attention_mask=None` and no KV cache) turns the restarts into a
  block-diagonal causal mask (`masking_utils.find_packed_sequence_indices`) for sdpa and eager alike.
- pixel values / grids are concatenated in segment order; the vision tower attends per image.
- `use_cache=False`, no attention mask.
`collate_padded` builds the classic right-padded batch of the same segments (for benchmarks).

Loss-side tensors follow one convention: a target position `t` means "the token `input_ids[t]`,
predicted by the logits at `t - 1`". `ce_weights[t]` weights that prediction; `coord_positions`
hold target positions of coordinate tokens. All positions index the flattened (batch * L) token axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from transformers import PreTrainedModel

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
    """Spread segments over at most `num_packs` packs of at most `packing_length` tokens each, as evenly as
    possible (largest first, each into the emptiest pack that takes it). Returns the packs (indices
    ascending, empty packs left out) and the indices that fit nowhere (largest first left over)."""
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


# ---------------------------------------------------------------- segments and the collator


@dataclass(frozen=True)
class CoordGroup:
    """One box: the target positions of its 4 coordinate tokens (x1, y1, x2, y2) and their GT bins."""

    positions: tuple[int, int, int, int]  # target positions in the segment's input_ids
    gt_bins: tuple[int, int, int, int]  # 0..999


@dataclass
class Segment:
    """One teacher-forced sample, ready to pack.

    `ce_weights[t]` is the CE weight of predicting `input_ids[t]` from the logits at `t - 1`
    (so `ce_weights[0]` must be 0; prompt positions are 0).
    """

    input_ids: list[int]  # (T,)
    ce_weights: list[float]  # (T,)
    mm_token_type_ids: list[int]  # (T,) 0 text, 1 image token
    pixel_values: torch.Tensor | None  # (num_patches, patch_dim), None for text-only
    image_grid_thw: torch.Tensor | None  # (num_images, 3)
    coord_groups: list[CoordGroup] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.ce_weights) != n or len(self.mm_token_type_ids) != n:
            raise ValueError(
                f"segment fields disagree in length: input_ids {n}, ce_weights {len(self.ce_weights)}, "
                f"mm_token_type_ids {len(self.mm_token_type_ids)}"
            )
        if n and self.ce_weights[0] != 0:
            raise ValueError("ce_weights[0] must be 0: nothing predicts the first token")
        for group in self.coord_groups:
            if not all(0 < p < n for p in group.positions):
                raise ValueError(f"coordinate positions {group.positions} outside 1..{n - 1}")

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class PackedBatch:
    """One micro-batch (a pack, or a padded batch). `model_inputs()` is what `model(...)` takes."""

    input_ids: torch.Tensor  # (B, L) long
    position_ids: torch.Tensor | None  # (4, 1, L) long for packs; None (model computes) for padded
    attention_mask: torch.Tensor | None  # (B, L) long for padded; None for packs
    mm_token_type_ids: torch.Tensor  # (B, L) int
    pixel_values: torch.Tensor | None  # (num_patches, patch_dim)
    image_grid_thw: torch.Tensor | None  # (num_images, 3)
    ce_weights: torch.Tensor  # (B, L) float; see the module docstring for the convention
    coord_positions: torch.Tensor  # (G, 4) long, target positions on the flattened B * L axis
    coord_targets: torch.Tensor  # (G, 4) long, GT bins 0..999
    segment_starts: list[int]  # flattened start offset of each segment
    segment_lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.segment_lengths)

    def model_inputs(self) -> dict[str, Any]:
        inputs: dict[str, Any] = {"input_ids": self.input_ids, "use_cache": False}
        # A text model's pack has plain (1, L) positions and takes no multimodal token types.
        if self.position_ids is None or self.position_ids.dim() == 3:
            inputs["mm_token_type_ids"] = self.mm_token_type_ids
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        if self.pixel_values is not None:
            inputs["pixel_values"] = self.pixel_values
            inputs["image_grid_thw"] = self.image_grid_thw
        return inputs

    def to(self, device: torch.device | str) -> PackedBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=move(self.position_ids),
            attention_mask=move(self.attention_mask),
            mm_token_type_ids=self.mm_token_type_ids.to(device),
            pixel_values=move(self.pixel_values),
            image_grid_thw=move(self.image_grid_thw),
            ce_weights=self.ce_weights.to(device),
            coord_positions=self.coord_positions.to(device),
            coord_targets=self.coord_targets.to(device),
            segment_starts=self.segment_starts,
            segment_lengths=self.segment_lengths,
        )


def segment_position_ids(segment: Segment, model: PreTrainedModel) -> torch.Tensor:
    """Positions of one segment alone. A vision-language model: (4, T), text positions 0..T-1, then the
    (t, h, w) multimodal rotary rows (`stagectl.models.qwen_vl`, Qwen-VL only: another family fails
    naming what is missing). A text model of any architecture: (1, T), 0..T-1 (restarting positions are
    all it needs to read a pack as separate sequences)."""
    from stagectl.models import qwen_vl  # image processors: only packers need them

    text_positions = torch.arange(len(segment), dtype=torch.long).view(1, -1)
    if not qwen_vl.is_vision_language(model.config):
        if segment.pixel_values is not None:
            raise ValueError(f"a segment has images but {model.config.model_type!r} is a text-only model")
        return text_positions
    vision_positions = qwen_vl.rope_position_ids(
        model, segment.input_ids, segment.mm_token_type_ids, segment.image_grid_thw
    )  # (3, T)
    return torch.cat([text_positions, vision_positions], dim=0)


def _concat_images(segments: Sequence[Segment]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    with_images = [s for s in segments if s.pixel_values is not None]
    if not with_images:
        return None, None
    pixel_values = torch.cat([s.pixel_values for s in with_images if s.pixel_values is not None], dim=0)
    grids = torch.cat([s.image_grid_thw for s in with_images if s.image_grid_thw is not None], dim=0)
    return pixel_values, grids


def _coord_tensors(segments: Sequence[Segment], starts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    positions = [
        [start + p for p in g.positions]
        for s, start in zip(segments, starts, strict=True)
        for g in s.coord_groups
    ]
    targets = [list(g.gt_bins) for s in segments for g in s.coord_groups]
    return (
        torch.tensor(positions, dtype=torch.long).view(-1, 4),
        torch.tensor(targets, dtype=torch.long).view(-1, 4),
    )


def collate_pack(segments: Sequence[Segment], model: PreTrainedModel) -> PackedBatch:
    """Concatenate `segments` into one packed micro-batch of batch size 1 (see the module docstring).

    `position_ids` is (4, 1, L) for a Qwen-VL model and (1, L) for a text model (any architecture that
    reads restarting positions as separate sequences; such a pack carries no multimodal token types)."""
    if not segments:
        raise ValueError("collate_pack needs at least one segment")
    lengths = [len(s) for s in segments]
    starts = [sum(lengths[:i]) for i in range(len(segments))]
    total = sum(lengths)
    rows = torch.cat([segment_position_ids(s, model) for s in segments], dim=1)  # (4, L) or (1, L)
    position_ids = rows.unsqueeze(1) if rows.shape[0] == 4 else rows  # (4, 1, L) VLM, (1, L) text
    pixel_values, grids = _concat_images(segments)
    coord_positions, coord_targets = _coord_tensors(segments, starts)
    return PackedBatch(
        input_ids=torch.tensor([[i for s in segments for i in s.input_ids]], dtype=torch.long).view(1, total),
        position_ids=position_ids,
        attention_mask=None,
        mm_token_type_ids=torch.tensor([[m for s in segments for m in s.mm_token_type_ids]], dtype=torch.int),
        pixel_values=pixel_values,
        image_grid_thw=grids,
        ce_weights=torch.tensor([[w for s in segments for w in s.ce_weights]], dtype=torch.float32),
        coord_positions=coord_positions,
        coord_targets=coord_targets,
        segment_starts=starts,
        segment_lengths=lengths,
    )


def collate_padded(segments: Sequence[Segment], pad_token_id: int) -> PackedBatch:
    """The same segments as a right-padded batch (B, max T) with an attention mask (benchmark baseline).

    Positions are left to the model (it computes the rope index from `mm_token_type_ids` and the mask).
    """
    if not segments:
        raise ValueError("collate_padded needs at least one segment")
    lengths = [len(s) for s in segments]
    width = max(lengths)
    input_ids = torch.full((len(segments), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(segments), width), dtype=torch.long)
    mm_types = torch.zeros((len(segments), width), dtype=torch.int)
    ce_weights = torch.zeros((len(segments), width), dtype=torch.float32)
    for row, s in enumerate(segments):
        input_ids[row, : len(s)] = torch.tensor(s.input_ids, dtype=torch.long)
        attention_mask[row, : len(s)] = 1
        mm_types[row, : len(s)] = torch.tensor(s.mm_token_type_ids, dtype=torch.int)
        ce_weights[row, : len(s)] = torch.tensor(s.ce_weights, dtype=torch.float32)
    starts = [row * width for row in range(len(segments))]
    pixel_values, grids = _concat_images(segments)
    coord_positions, coord_targets = _coord_tensors(segments, starts)
    return PackedBatch(
        input_ids=input_ids,
        position_ids=None,
        attention_mask=attention_mask,
        mm_token_type_ids=mm_types,
        pixel_values=pixel_values,
        image_grid_thw=grids,
        ce_weights=ce_weights,
        coord_positions=coord_positions,
        coord_targets=coord_targets,
        segment_starts=starts,
        segment_lengths=lengths,
    )
