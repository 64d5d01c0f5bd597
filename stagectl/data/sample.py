"""The detection sample every data source produces, and the pixel <-> norm-1000 box codec it is stored in.

A sample is `{images, width, height, objects: [{desc, bbox_2d}]}` (docs/design.md#data-and-the-answer-format). Boxes are
stored as norm-1000 bins: integers 0..999 with `bin = round(999 * x / (W - 1))`, clamped to 0..999,
decoded as `x = bin / 999 * (W - 1)`. Pixel coordinates are corner positions on the 0..W-1 axis, so a
box that covers the whole image is `(0, 0, W-1, H-1)` -> `(0, 0, 999, 999)`.
The codec itself is `stagectl/detection/coords.py`'s; this module gives it its data names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stagectl.detection.coords import Box, bins_to_box, box_to_bins
from stagectl.detection.serialize import object_record

# The norm-1000 codec lives in `detection.coords`; these are its names in data terms.
pixel_box_to_bins = box_to_bins
bins_to_pixel_box = bins_to_box


@dataclass(frozen=True)
class DetObject:
    """One ground-truth object: a short description and its box in norm-1000 bins."""

    desc: str
    bbox_2d: Box
    category_id: int | None = None  # the COCO category id, when the data came from COCO
    # COCO's `area` in pixels (the mask's, for COCO's own files): the eval's small / medium / large bucket
    # uses it as COCOeval does; None: the box's area
    area: float | None = None


@dataclass(frozen=True)
class DetectionSample:
    """One detection example. `images` are absolute paths once loaded; `width`/`height` are the pixel
    size of the image the boxes refer to (the first one)."""

    images: list[str]
    width: int
    height: int
    objects: list[DetObject] = field(default_factory=list)
    image_id: int | None = None  # the COCO image id, when the data came from COCO
    # COCO `iscrowd: 1` regions (`stagectl convert coco` keeps them): never trained on; the eval's ground
    # truth marks them crowd, so predictions on them are ignored, not false positives (COCOeval's rule)
    crowd: list[DetObject] = field(default_factory=list)
    # the line of the JSONL file it was read from (errors about the sample name it); None: not read from a file
    line_no: int | None = field(default=None, compare=False, repr=False)

    def pixel_boxes(self) -> list[tuple[float, float, float, float]]:
        """Every object's box decoded back to pixels, in object order."""
        return [bins_to_pixel_box(obj.bbox_2d, self.width, self.height) for obj in self.objects]

    def to_json_dict(self) -> dict[str, Any]:
        """The JSONL line form (boxes in norm-1000 bins); `load_jsonl_dataset` reads it back."""
        record: dict[str, Any] = {
            "images": list(self.images),
            "width": self.width,
            "height": self.height,
            "objects": [_object_line(obj) for obj in self.objects],
        }
        if self.image_id is not None:
            record["image_id"] = self.image_id
        if self.crowd:
            record["crowd"] = [_object_line(obj) for obj in self.crowd]
        return record


def _object_line(obj: DetObject) -> dict[str, Any]:
    record = object_record(obj)
    if obj.category_id is not None:
        record["category_id"] = obj.category_id
    if obj.area is not None:
        record["area"] = obj.area
    return record
