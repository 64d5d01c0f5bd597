"""The detection sample every data source produces, and the pixel <-> norm-1000 box codec it is stored in.

A sample is `{images, width, height, objects: [{desc, bbox_2d}]}` (DESIGN.md section 5). Boxes are
stored as norm-1000 bins: integers 0..999 with `bin = round(999 * x / (W - 1))`, clamped to 0..999,
decoded as `x = bin / 999 * (W - 1)`. Pixel coordinates are corner positions on the 0..W-1 axis, so a
box that covers the whole image is `(0, 0, W-1, H-1)` -> `(0, 0, 999, 999)`.

Note: `stagectl/detection/coords.py` owns the same codec for the coordinate tokens; it was not committed
when this module was written, so the two helpers below are a private copy of the same formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NUM_BINS = 1000
MAX_BIN = NUM_BINS - 1

Box = tuple[int, int, int, int]  # (x1, y1, x2, y2)


def _pixel_to_bin(x: float, size: int) -> int:
    """Pixel coordinate on the 0..size-1 axis -> norm-1000 bin (round, then clamp to 0..999)."""
    if size <= 1:
        return 0
    return min(MAX_BIN, max(0, round(MAX_BIN * x / (size - 1))))


def _bin_to_pixel(value: int, size: int) -> float:
    """Norm-1000 bin -> pixel coordinate on the 0..size-1 axis."""
    return value / MAX_BIN * (size - 1)


def pixel_box_to_bins(box: tuple[float, float, float, float], width: int, height: int) -> Box:
    """`(x1, y1, x2, y2)` in pixels -> the same box in norm-1000 bins."""
    x1, y1, x2, y2 = box
    return (
        _pixel_to_bin(x1, width),
        _pixel_to_bin(y1, height),
        _pixel_to_bin(x2, width),
        _pixel_to_bin(y2, height),
    )


def bins_to_pixel_box(box: Box, width: int, height: int) -> tuple[float, float, float, float]:
    """`(x1, y1, x2, y2)` in norm-1000 bins -> the same box in (fractional) pixels."""
    x1, y1, x2, y2 = box
    return (
        _bin_to_pixel(x1, width),
        _bin_to_pixel(y1, height),
        _bin_to_pixel(x2, width),
        _bin_to_pixel(y2, height),
    )


@dataclass(frozen=True)
class DetObject:
    """One ground-truth object: a short description and its box in norm-1000 bins."""

    desc: str
    bbox_2d: Box


@dataclass(frozen=True)
class DetectionSample:
    """One detection example. `images` are absolute paths once loaded; `width`/`height` are the pixel
    size of the image the boxes refer to (the first one)."""

    images: list[str]
    width: int
    height: int
    objects: list[DetObject] = field(default_factory=list)

    def pixel_boxes(self) -> list[tuple[float, float, float, float]]:
        """Every object's box decoded back to pixels, in object order."""
        return [bins_to_pixel_box(obj.bbox_2d, self.width, self.height) for obj in self.objects]

    def to_json_dict(self) -> dict[str, Any]:
        """The JSONL line form (boxes in norm-1000 bins); `load_jsonl_dataset` reads it back."""
        return {
            "images": list(self.images),
            "width": self.width,
            "height": self.height,
            "objects": [{"desc": obj.desc, "bbox_2d": list(obj.bbox_2d)} for obj in self.objects],
        }
