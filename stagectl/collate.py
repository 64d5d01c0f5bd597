"""Segments and the collators: how a pack (see `stagectl.packing`) becomes one micro-batch.

Collator: `collate_pack` concatenates segments into ONE batch-size-1 sequence that the model reads
exactly as it would read each segment alone:
- `position_ids` has shape (4, 1, L): row 0 is the text position restarting at 0 in every segment,
  rows 1..3 the multimodal rotary (t, h, w) positions, computed per segment by the model's own
  `get_rope_index`. Transformers' Qwen-VL text models split row 0 off and pass it to
  `create_causal_mask`, which (with `attention_mask=None` and no KV cache) turns the restarts into a
  block-diagonal causal mask (`masking_utils.find_packed_sequence_indices`) for sdpa and eager alike.
- pixel values / grids are concatenated in segment order; the vision tower attends per image.
- `use_cache=False`, no attention mask.
`collate_padded` builds the classic right-padded batch of the same segments (`training.packing: false`).

Loss-side tensors follow one convention: a target position `t` means "the token `input_ids[t]`,
predicted by the logits at `t - 1`". `ce_weights[t]` weights that prediction; `coord_positions`
hold target positions of coordinate tokens. All positions index the flattened (batch * L) token axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from stagectl.detection.targets import CoordGroup  # one box's 4 coordinate positions and GT bins

__all__ = ["CoordGroup", "PackedBatch", "Segment", "collate_pack", "collate_padded", "segment_position_ids"]


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
