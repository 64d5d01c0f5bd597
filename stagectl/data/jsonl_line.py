"""One line of a detection JSONL parsed and checked, its boxes as written (the box format is decided for the
whole file by `stagectl.data.jsonl`, which also collects the errors): the fields a line and an object may
hold, the image paths (each must exist; with `verify_images`, open and have the line's size), and `bbox_2d`
as four numbers or four `<|coord_k|>` tokens. `LineError` is a problem of the line; the loader names its
`file:line`.

Besides stagectl's own fields, a line may carry what upstream's writers add, checked and not used:
CoordExp's `summary` (a string) and `metadata` (an object), and the provenance its COCO converter writes
(`file_name` on the line; `category_name`, `coco_ann_id` and `object_id` on an object)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagectl.detection.coords import MAX_BIN
from stagectl.detection.entries import spells_special_token
from stagectl.wire.text import NOT_TEXT, holds_lone_surrogate

SAMPLE_FIELDS = ("images", "width", "height", "objects")
OBJECT_FIELDS = ("desc", "bbox_2d")
# optional ids that `stagectl convert coco` writes, so predictions go back in COCO's own ids
# ... and what upstream's writers add (checked, not used): CoordExp's `summary` and `metadata`, the provenance
# of its COCO converter (`file_name`; an object's `category_name`, `coco_ann_id`, `object_id`)
SAMPLE_OPTIONAL = ("image_id", "crowd", "summary", "metadata", "file_name")
OBJECT_OPTIONAL = ("category_id", "area", "category_name", "coco_ann_id", "object_id")
# CoordExp's pre-tokenized coordinate: one norm-1000 bin as a special token
COORD_TOKEN = re.compile(r"^<\|coord_([0-9]{1,4})\|>$")


class LineError(Exception):
    """A problem with one line; turned into a `file:line:` entry by the loader."""


@dataclass(frozen=True)
class RawObject:
    desc: str
    box: tuple[float, float, float, float]  # as written in the file, format not yet known
    category_id: int | None
    from_tokens: bool = False  # written as `<|coord_k|>` tokens: norm-1000 bins whatever box_format says
    area: float | None = None  # COCO's `area` (pixels), when written


@dataclass(frozen=True)
class RawSample:
    line_no: int
    images: list[str]  # absolute
    width: int
    height: int
    objects: list[RawObject]
    image_id: int | None
    crowd: list[RawObject]  # COCO iscrowd regions: eval-only ground truth


def decode_line(raw_line: bytes, line_no: int) -> str:
    if line_no == 1:  # a UTF-8 byte-order mark (Windows editors, PowerShell) starts the file, not the JSON
        raw_line = raw_line.removeprefix(b"\xef\xbb\xbf")
    try:
        return raw_line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineError(f"not UTF-8 text (byte {exc.start + 1} of the line)") from None


def parse_line(
    line: str, line_no: int, root: Path, seen_images: dict[str, ImageCheck], verify_images: bool
) -> RawSample:
    """Check one line's structure (everything that does not depend on the box format)."""
    text = line.rstrip("\r\n")  # with the newline, an error at the end of the line reads "line 2, column 1"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        where = " (the end of the line: a truncated line?)" if exc.pos >= len(text) else ""
        raise LineError(f"malformed JSON: {exc.msg} (column {exc.pos + 1}{where})") from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer of > 4300 digits, nesting too deep
        raise LineError(f"malformed JSON: {str(exc) or type(exc).__name__}") from None
    if not isinstance(record, dict):
        raise LineError(f"a line must be a JSON object, got {type(record).__name__}")
    if "annotations" in record or "categories" in record:  # the instances JSON itself given as the data
        raise LineError(
            "this is a COCO instances file (images, annotations, categories), not a detection JSONL: convert "
            "it with `stagectl convert coco FILE --images IMAGE_DIR --out OUT.jsonl`, then use OUT.jsonl "
            "with data.box_format: pixel"
        )
    if holds_lone_surrogate(record):
        raise LineError(NOT_TEXT)
    _check_fields(record, SAMPLE_FIELDS, where="", optional=SAMPLE_OPTIONAL)
    if not isinstance(record.get("summary", ""), str):
        raise LineError(f"summary must be a string, got {type(record['summary']).__name__}")
    if not isinstance(record.get("metadata", {}), dict):
        raise LineError(f"metadata must be an object, got {type(record['metadata']).__name__}")
    if not isinstance(record.get("file_name", ""), str):
        raise LineError(f"file_name must be a string, got {type(record['file_name']).__name__}")

    width = _positive_int(record["width"], "width")
    height = _positive_int(record["height"], "height")
    images = _image_paths(record["images"], root, seen_images, verify_images)
    size = seen_images[images[0]].size  # None unless verify_images
    if size is not None and size != (width, height):
        raise LineError(
            f"image {images[0]} is {size[0]}x{size[1]} but the line says width {width}, height {height}: "
            f"every box would be scaled against the wrong size; write the image's real size (width "
            f"{size[0]}, height {size[1]}) and boxes that refer to it"
        )

    objects_field = record["objects"]
    if not isinstance(objects_field, list):
        raise LineError(f"objects must be a list, got {type(objects_field).__name__}")
    objects = [_parse_object(item, index) for index, item in enumerate(objects_field)]
    crowd_field = record.get("crowd", [])
    if not isinstance(crowd_field, list):
        raise LineError(f"crowd must be a list, got {type(crowd_field).__name__}")
    crowd = [_parse_object(item, index, "crowd") for index, item in enumerate(crowd_field)]
    image_id = _optional_id(record, "image_id", where="")
    return RawSample(
        line_no=line_no,
        images=images,
        width=width,
        height=height,
        objects=objects,
        image_id=image_id,
        crowd=crowd,
    )


def _check_fields(
    record: dict[str, Any], required: tuple[str, ...], where: str, optional: tuple[str, ...] = ()
) -> None:
    for name in required:
        if name not in record:
            raise LineError(f"{where}missing field {name!r}")
    allowed = required + optional
    for name in record:
        if name not in allowed:
            raise LineError(f"{where}unknown field {name!r} (allowed: {', '.join(allowed)})")


def _optional_id(record: dict[str, Any], name: str, where: str) -> int | None:
    """An optional non-negative integer id (`image_id`, `category_id`); None when absent."""
    if name not in record:
        return None
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LineError(f"{where}{name} must be a non-negative integer, got {value!r}")
    return value


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LineError(f"{name} must be a positive integer, got {value!r}")
    return value


def _image_paths(
    value: Any, root: Path, seen_images: dict[str, ImageCheck], verify_images: bool
) -> list[str]:
    if not isinstance(value, list) or not value:
        raise LineError(f"images must be a non-empty list of paths, got {value!r}")
    paths: list[str] = []
    for item in value:
        if not isinstance(item, str) or not item or "\0" in item:
            raise LineError(f"images must hold non-empty path strings, got {item!r}")
        full = os.path.abspath(os.path.join(root, item))  # an absolute `item` replaces `root`
        if full not in seen_images:
            seen_images[full] = _check_image(full, verify_images)
        problem = seen_images[full].problem
        if problem is not None:
            raise LineError(problem)
        paths.append(full)
    return paths


@dataclass(frozen=True)
class ImageCheck:
    problem: str | None  # what is wrong with the file (None: usable)
    size: tuple[int, int] | None  # (width, height) from its header; None when not opened


def _check_image(full: str, verify: bool) -> ImageCheck:
    """Whether the image file at `full` is usable and, with `verify`, its size."""
    if not os.path.isfile(full):
        return ImageCheck(f"image not found: {full}", None)
    if not verify:
        return ImageCheck(None, None)
    from PIL import Image  # only when asked: the data module stays light for `validate-config`

    try:
        with Image.open(full) as image:
            size = image.size  # from the header
            image.verify()  # reads the file's structure and checksums, decodes no pixels
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        return ImageCheck(f"image {full} is not a readable image: {str(exc) or type(exc).__name__}", None)
    return ImageCheck(None, (int(size[0]), int(size[1])))


def _parse_object(item: Any, index: int, kind: str = "objects") -> RawObject:
    where = f"{kind}[{index}]: "
    if not isinstance(item, dict):
        raise LineError(f"{where}must be an object with desc and bbox_2d, got {item!r}")
    if "poly" in item and "bbox_2d" not in item:
        raise LineError(
            f"{where}a poly geometry (CoordExp's polygon) is not read: stagectl trains boxes; give the object "
            "a bbox_2d (the polygon's bounding box) or leave it out"
        )
    _check_fields(item, OBJECT_FIELDS, where=where, optional=OBJECT_OPTIONAL)
    _check_provenance(item, where)
    desc = item["desc"]
    if not isinstance(desc, str) or not desc.strip():
        raise LineError(f"{where}desc must be a non-empty string, got {desc!r}")
    if spells_special_token(desc):  # the rule the strict parse applies to a rollout
        raise LineError(
            f"{where}desc {desc!r} spells a special token (<|...|>): in a target it would encode as that token, "
            "not as a label; rename the category"
        )
    box = item["bbox_2d"]
    x1, y1, x2, y2 = values = _box_values(box, where)
    from_tokens = isinstance(box[0], str)  # `_box_values` allows one form per box
    if x2 < x1:
        raise LineError(f"{where}bbox_2d {box} has x2 < x1")
    if y2 < y1:
        raise LineError(f"{where}bbox_2d {box} has y2 < y1")
    category_id = _optional_id(item, "category_id", where)
    area = item.get("area")
    if area is not None and (not _is_number(area) or area < 0):
        raise LineError(f"{where}area must be a non-negative number of pixels, got {area!r}")
    return RawObject(
        desc=desc, box=values, category_id=category_id, from_tokens=from_tokens, area=_number(area)
    )


def _check_provenance(item: dict[str, Any], where: str) -> None:
    """Upstream's per-object provenance, as its COCO converter writes it: a name and ids (not used)."""
    if not isinstance(item.get("category_name", ""), str):
        raise LineError(f"{where}category_name must be a string, got {item['category_name']!r}")
    for key in ("coco_ann_id", "object_id"):
        value = item.get(key, "")
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise LineError(f"{where}{key} must be an integer or a string, got {value!r}")


def _box_values(box: Any, where: str) -> tuple[float, float, float, float]:
    """The four coordinates of `bbox_2d`, written as numbers or as `<|coord_k|>` tokens (one form per box)."""
    shape = f"{where}bbox_2d must be 4 numbers [x1, y1, x2, y2] or 4 <|coord_k|> tokens, got {box!r}"
    if not isinstance(box, list) or len(box) != 4:
        raise LineError(shape)
    if all(_is_number(v) for v in box):
        x1, y1, x2, y2 = (float(v) for v in box)
        return (x1, y1, x2, y2)
    if not all(isinstance(v, str) for v in box):
        if any(isinstance(v, str) and v.startswith("<|coord_") for v in box):
            raise LineError(
                f"{where}bbox_2d {box!r} mixes numbers and <|coord_k|> tokens: write one form per box"
            )
        raise LineError(shape)
    bins: list[float] = []
    for index, token in enumerate(box):
        match = COORD_TOKEN.match(token)
        if match is None or int(match.group(1)) > MAX_BIN:
            raise LineError(
                f"{where}bbox_2d[{index}] {token!r} is not a coordinate token <|coord_k|> with k in 0..{MAX_BIN}"
            )
        bins.append(float(match.group(1)))
    return (bins[0], bins[1], bins[2], bins[3])


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: Any) -> float | None:
    return None if value is None else float(value)
