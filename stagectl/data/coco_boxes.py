"""What one COCO box becomes on its way to the detection JSONL (`clip_box`), and `CocoStats`, the counts of
what a `stagectl convert coco` run wrote and left out.

A box is written in pixels, but the loader stores it on the norm-1000 grid (`data.box_format: pixel`,
`stagectl.data.sample.pixel_box_to_bins`): a box whose two x (or two y) edges fall in one bin there is as
zero-area as a COCO `w: 0` box (a 0.9 px wide box on a 1920 px image: one bin is 1.92 px), so it is left out
and counted the same way, not trained on as a zero-width target nor scored as a ground truth no prediction
can overlap.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from stagectl.data.sample import pixel_box_to_bins

Box = tuple[float, float, float, float]


def clip_box(xywh: Box, width: int, height: int) -> tuple[Box | None, str]:
    """COCO `[x, y, w, h]` -> pixel corners clamped to `[0, W] x [0, H]`, and what happened: `kept`,
    `clamped`, or (box None) `zero_area` / `outside` / `zero_on_grid` (zero width or height once binned)."""
    x, y, w, h = xywh
    if w <= 0 or h <= 0:
        return None, "zero_area"
    x2, y2 = x + w, y + h
    right, bottom = float(width), float(height)
    cx1, cx2 = min(max(x, 0.0), right), min(max(x2, 0.0), right)
    cy1, cy2 = min(max(y, 0.0), bottom), min(max(y2, 0.0), bottom)
    if cx2 <= cx1 or cy2 <= cy1:
        return None, "outside"
    box = (tidy(cx1), tidy(cy1), tidy(cx2), tidy(cy2))
    bx1, by1, bx2, by2 = pixel_box_to_bins(box, width, height)  # as the loader stores it
    if bx2 == bx1 or by2 == by1:
        return None, "zero_on_grid"
    return box, "kept" if (cx1, cy1, cx2, cy2) == (x, y, x2, y2) else "clamped"


def tidy(value: float) -> float:
    """Round away the float noise of `x + w` (1e-6 px); integral values are written as integers."""
    rounded = round(value, 6)
    return int(rounded) if rounded.is_integer() else rounded


@dataclass
class CocoStats:
    """What a conversion wrote and what it left out."""

    num_images: int = 0  # JSONL lines written
    num_empty: int = 0  # of those, lines with no object
    num_objects: int = 0
    num_categories: int = 0
    num_dropped_empty: int = 0  # images left out by `drop_empty`
    num_crowd: int = 0  # `iscrowd: 1` annotations kept as crowd regions (eval only, never trained on)
    num_zero_area: int = 0  # boxes of zero (or negative) width or height left out
    num_zero_on_grid: int = 0  # boxes of zero width or height on the norm-1000 grid left out
    num_outside: int = 0  # boxes wholly outside their image left out
    num_clamped: int = (
        0  # objects partly outside their image, clamped and kept (crowd regions: clamped alike)
    )
    class_counts: Counter[str] = field(default_factory=Counter)

    def summary(self, out: Path, top: int = 10) -> str:
        """The one summary line `stagectl convert coco` prints."""
        classes = ", ".join(f"{name} {count}" for name, count in self.class_counts.most_common(top))
        skipped = (
            f"{self.num_zero_area} zero-area, {self.num_zero_on_grid} zero-area on the norm-1000 grid, "
            f"{self.num_outside} outside the image"
        )
        if self.num_dropped_empty:
            skipped += f", {self.num_dropped_empty} images without objects (--drop-empty)"
        return (
            f"wrote {self.num_images} images ({self.num_empty} without objects), {self.num_objects} objects "
            f"of {self.num_categories} categories to {out}; top classes: {classes or 'none'}; "
            f"crowd regions (iscrowd: 1, eval only, not trained on): {self.num_crowd}; "
            f"skipped: {skipped}; clamped to the image: {self.num_clamped}; "
            "boxes are pixel xyxy: train with data.box_format: pixel"
        )
