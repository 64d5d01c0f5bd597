"""Loading a detection data set from JSONL, with every bad line reported as `file:line: what is wrong`.

One line is one sample:

    {"images": ["img/0001.png"], "width": 640, "height": 480,
     "objects": [{"desc": "red circle", "bbox_2d": [x1, y1, x2, y2]}, ...]}

Image paths are relative to `image_root` (default: the JSONL file's directory) unless absolute; they
come back absolute, and every image must exist (a cheap stat, the file is not opened; with
`verify_images=True` each image is also opened and checked by pillow, without decoding its pixels,
so a corrupt file is reported at its line instead of failing mid-training). `width` and `height` are
the pixel size of the image the boxes refer to, the line's first image: with `verify_images=True` a
line whose first image has another size (read from its header) is a line error, since every box would
be scaled against the wrong size. Two optional ids ride along from `stagectl convert coco`:
`image_id` on the line and `category_id` on an object (non-negative integers; COCO's own ids, so
`stagectl eval` writes predictions in them), and an object's COCO `area` (pixels, the mask's in COCO's
own files), which the eval's small / medium / large buckets use as COCOeval does. A line may also hold `crowd`: COCO's `iscrowd: 1` regions
as `stagectl convert coco` keeps them, objects written like `objects` (`desc`, `bbox_2d` in the file's box
format, `category_id`). They are never trained on; the eval's ground truth marks them crowd, so COCOeval
ignores predictions on them instead of counting false positives, as the official evaluation does.
CoordExp's optional `summary` (a string) and `metadata` (an object) are checked and not used; its `poly`
objects are a line error (boxes only). Blank lines are skipped, and so is a UTF-8 byte-order mark at the start
of the file; no other field is allowed.
Text that is not UTF-8, JSON nested too deeply and lone-surrogate escapes are line errors too.

`bbox_2d` is written as four numbers or, as CoordExp's converter writes it (`*.coord.jsonl`), as four
pre-tokenized strings `"<|coord_k|>"` with k in 0..999. A token box is a norm-1000 box by definition: it
loads under `norm1000` and `auto` and is refused under `pixel`; a box mixing numbers and tokens, or a
token that is not `<|coord_k|>` with k in 0..999, is a line error naming it.

Boxes are read as `box_format`:
- `"norm1000"` (the default, and what `stagectl demo-data` writes): integers 0..999 (docs/design.md#data-and-the-answer-format);
  a box that is not, but fits the image's pixel size (what `stagectl convert coco` writes), is refused
  with a message that asks for `data.box_format: pixel`;
- `"pixel"`: numbers with `0 <= x <= width`, `0 <= y <= height` (corners on the 0..W-1 axis; a right or
  bottom edge equal to `width`/`height`, the exclusive-edge habit, is accepted and clamps to bin 999);
  a box that is not, but is a norm-1000 box, is refused with a message that asks for `data.box_format: norm1000`;
- `"auto"`: decided once for the whole file: pixel if any coordinate is fractional or above 1000 (integers
  up to exactly 1000 could be a 0..1000 normalised scale as well as pixels: an error asking for an explicit
  `box_format`),
  norm-1000 if some box only fits its image read as bins, and an error asking for an explicit
  `box_format` when every box fits both readings.

Errors are collected, not stopped at: the whole file is checked (one problem reported per line), then
one `DataError` lists the first `MAX_REPORTED_ERRORS` problems in line order and counts the rest, so a
user fixes a broken file in one pass rather than one line per run.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from stagectl.data.sample import DetectionSample, DetObject, pixel_box_to_bins
from stagectl.detection.coords import MAX_BIN

BoxFormat = Literal["pixel", "norm1000", "auto"]

MAX_REPORTED_ERRORS = 20
SAMPLE_FIELDS = ("images", "width", "height", "objects")
OBJECT_FIELDS = ("desc", "bbox_2d")
# optional ids that `stagectl convert coco` writes, so predictions go back in COCO's own ids
# ... and CoordExp's contract's optional `summary` and `metadata` (checked, not used)
SAMPLE_OPTIONAL = ("image_id", "crowd", "summary", "metadata")
OBJECT_OPTIONAL = ("category_id", "area")
# CoordExp's pre-tokenized coordinate: one norm-1000 bin as a special token
COORD_TOKEN = re.compile(r"^<\|coord_([0-9]{1,4})\|>$")


class DataError(ValueError):
    """A data set that cannot be used. `errors` holds one `file:line: what is wrong` entry per bad line
    (at most `MAX_REPORTED_ERRORS`); `num_errors` counts all of them."""

    def __init__(self, errors: list[str], num_errors: int | None = None) -> None:
        self.errors = list(errors)
        self.num_errors = len(errors) if num_errors is None else num_errors
        message = "\n".join(self.errors)
        if self.num_errors > len(self.errors):
            message += f"\n... and {self.num_errors - len(self.errors)} more bad lines"
        super().__init__(message)


class _LineError(Exception):
    """A problem with one line; turned into a `file:line:` entry by the loader."""


@dataclass(frozen=True)
class _RawObject:
    desc: str
    box: tuple[float, float, float, float]  # as written in the file, format not yet known
    category_id: int | None
    from_tokens: bool = False  # written as `<|coord_k|>` tokens: norm-1000 bins whatever box_format says
    area: float | None = None  # COCO's `area` (pixels), when written


@dataclass(frozen=True)
class _RawSample:
    line_no: int
    images: list[str]  # absolute
    width: int
    height: int
    objects: list[_RawObject]
    image_id: int | None
    crowd: list[_RawObject]  # COCO iscrowd regions: eval-only ground truth


def load_jsonl_dataset(
    path: str | os.PathLike[str],
    image_root: str | os.PathLike[str] | None = None,
    *,
    box_format: BoxFormat = "norm1000",
    verify_images: bool = False,
) -> list[DetectionSample]:
    """Read and validate a detection JSONL file; boxes come back in norm-1000 bins."""
    path = Path(path)
    if not path.is_file():
        raise DataError([f"{path}: no such file"])
    root = Path(image_root) if image_root is not None else path.parent
    root = Path(os.path.abspath(root))
    errors: list[tuple[int, str]] = []  # (line number, full message); 0 for file-level problems
    raws: list[_RawSample] = []
    seen_images: dict[str, _ImageCheck] = {}  # absolute path -> what is wrong with it, its size
    with path.open("rb") as handle:
        for line_no, raw_line in enumerate(handle, start=1):
            try:
                line = _decode(raw_line, line_no)
                if not line.strip():
                    continue
                raws.append(_parse_line(line, line_no, root, seen_images, verify_images))
            except _LineError as exc:
                errors.append((line_no, f"{path}:{line_no}: {exc}"))
    if not raws and not errors:
        raise DataError([f"{path}: no samples"])

    samples: list[DetectionSample] = []
    try:
        resolved = _detect_box_format(raws) if box_format == "auto" else box_format
    except _LineError as exc:
        errors.append((0, f"{path}: {exc}"))
    else:
        for raw in raws:
            try:
                samples.append(_to_sample(raw, resolved))
            except _LineError as exc:
                errors.append((raw.line_no, f"{path}:{raw.line_no}: {exc}"))
    if errors:
        errors.sort(key=lambda item: item[0])
        messages = [message for _, message in errors[:MAX_REPORTED_ERRORS]]
        raise DataError(messages, num_errors=len(errors))
    return samples


@dataclass(frozen=True)
class BoxReading:
    """How a file's boxes read (`read_box_format`)."""

    detected: Literal["pixel", "norm1000"] | None  # what `auto` makes of them; None: it cannot tell
    num_fit_neither: int  # boxes neither norm-1000 bins nor inside the image in pixels: no format loads them
    undecided: str | None = None  # why `auto` cannot tell, when it cannot


def read_box_format(
    path: str | os.PathLike[str], image_root: str | os.PathLike[str] | None = None
) -> BoxReading:
    """What `box_format: auto` makes of the file's boxes (lines that do not parse are left out; the loader
    reports them), and how many boxes fit neither reading (a typo such as 1000 in a norm-1000 file makes
    `auto` say pixel, but switching to pixel would not load them either)."""
    path = Path(path)
    root = Path(os.path.abspath(Path(image_root) if image_root is not None else path.parent))
    raws: list[_RawSample] = []
    seen_images: dict[str, _ImageCheck] = {}
    with path.open("rb") as handle:
        for line_no, raw_line in enumerate(handle, start=1):
            try:
                line = _decode(raw_line, line_no)
                if line.strip():
                    raws.append(_parse_line(line, line_no, root, seen_images, False))
            except _LineError:
                continue  # counted and reported by `load_jsonl_dataset`
    num_fit_neither = sum(
        not _fits_bins(obj.box) and not _fits_pixels(obj.box, raw.width, raw.height)
        for raw in raws
        for obj in raw.objects
    )
    try:
        return BoxReading(_detect_box_format(raws), num_fit_neither)
    except _LineError as exc:
        return BoxReading(None, num_fit_neither, undecided=str(exc))


def _decode(raw_line: bytes, line_no: int) -> str:
    if line_no == 1:  # a UTF-8 byte-order mark (Windows editors, PowerShell) starts the file, not the JSON
        raw_line = raw_line.removeprefix(b"\xef\xbb\xbf")
    try:
        return raw_line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _LineError(f"not UTF-8 text (byte {exc.start + 1} of the line)") from None


def _parse_line(
    line: str, line_no: int, root: Path, seen_images: dict[str, _ImageCheck], verify_images: bool
) -> _RawSample:
    """Check one line's structure (everything that does not depend on the box format)."""
    text = line.rstrip("\r\n")  # with the newline, an error at the end of the line reads "line 2, column 1"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        where = " (the end of the line: a truncated line?)" if exc.pos >= len(text) else ""
        raise _LineError(f"malformed JSON: {exc.msg} (column {exc.pos + 1}{where})") from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer of > 4300 digits, nesting too deep
        raise _LineError(f"malformed JSON: {str(exc) or type(exc).__name__}") from None
    if not isinstance(record, dict):
        raise _LineError(f"a line must be a JSON object, got {type(record).__name__}")
    if "annotations" in record or "categories" in record:  # the instances JSON itself given as the data
        raise _LineError(
            "this is a COCO instances file (images, annotations, categories), not a detection JSONL: convert "
            "it with `stagectl convert coco FILE --images IMAGE_DIR --out OUT.jsonl`, then use OUT.jsonl "
            "with data.box_format: pixel"
        )
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise _LineError("a string holds a lone surrogate escape (\\ud800-\\udfff); not valid text") from None
    _check_fields(record, SAMPLE_FIELDS, where="", optional=SAMPLE_OPTIONAL)
    if not isinstance(record.get("summary", ""), str):
        raise _LineError(f"summary must be a string, got {type(record['summary']).__name__}")
    if not isinstance(record.get("metadata", {}), dict):
        raise _LineError(f"metadata must be an object, got {type(record['metadata']).__name__}")

    width = _positive_int(record["width"], "width")
    height = _positive_int(record["height"], "height")
    images = _image_paths(record["images"], root, seen_images, verify_images)
    size = seen_images[images[0]].size  # None unless verify_images
    if size is not None and size != (width, height):
        raise _LineError(
            f"image {images[0]} is {size[0]}x{size[1]} but the line says width {width}, height {height}: "
            f"every box would be scaled against the wrong size; write the image's real size (width "
            f"{size[0]}, height {size[1]}) and boxes that refer to it"
        )

    objects_field = record["objects"]
    if not isinstance(objects_field, list):
        raise _LineError(f"objects must be a list, got {type(objects_field).__name__}")
    objects = [_parse_object(item, index) for index, item in enumerate(objects_field)]
    crowd_field = record.get("crowd", [])
    if not isinstance(crowd_field, list):
        raise _LineError(f"crowd must be a list, got {type(crowd_field).__name__}")
    crowd = [_parse_object(item, index, "crowd") for index, item in enumerate(crowd_field)]
    image_id = _optional_id(record, "image_id", where="")
    return _RawSample(
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
            raise _LineError(f"{where}missing field {name!r}")
    allowed = required + optional
    for name in record:
        if name not in allowed:
            raise _LineError(f"{where}unknown field {name!r} (allowed: {', '.join(allowed)})")


def _optional_id(record: dict[str, Any], name: str, where: str) -> int | None:
    """An optional non-negative integer id (`image_id`, `category_id`); None when absent."""
    if name not in record:
        return None
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _LineError(f"{where}{name} must be a non-negative integer, got {value!r}")
    return value


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _LineError(f"{name} must be a positive integer, got {value!r}")
    return value


def _image_paths(
    value: Any, root: Path, seen_images: dict[str, _ImageCheck], verify_images: bool
) -> list[str]:
    if not isinstance(value, list) or not value:
        raise _LineError(f"images must be a non-empty list of paths, got {value!r}")
    paths: list[str] = []
    for item in value:
        if not isinstance(item, str) or not item or "\0" in item:
            raise _LineError(f"images must hold non-empty path strings, got {item!r}")
        full = os.path.abspath(os.path.join(root, item))  # an absolute `item` replaces `root`
        if full not in seen_images:
            seen_images[full] = _check_image(full, verify_images)
        problem = seen_images[full].problem
        if problem is not None:
            raise _LineError(problem)
        paths.append(full)
    return paths


@dataclass(frozen=True)
class _ImageCheck:
    problem: str | None  # what is wrong with the file (None: usable)
    size: tuple[int, int] | None  # (width, height) from its header; None when not opened


def _check_image(full: str, verify: bool) -> _ImageCheck:
    """Whether the image file at `full` is usable and, with `verify`, its size."""
    if not os.path.isfile(full):
        return _ImageCheck(f"image not found: {full}", None)
    if not verify:
        return _ImageCheck(None, None)
    from PIL import Image  # only when asked: the data module stays light for `validate-config`

    try:
        with Image.open(full) as image:
            size = image.size  # from the header
            image.verify()  # reads the file's structure and checksums, decodes no pixels
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        return _ImageCheck(f"image {full} is not a readable image: {str(exc) or type(exc).__name__}", None)
    return _ImageCheck(None, (int(size[0]), int(size[1])))


def _parse_object(item: Any, index: int, kind: str = "objects") -> _RawObject:
    where = f"{kind}[{index}]: "
    if not isinstance(item, dict):
        raise _LineError(f"{where}must be an object with desc and bbox_2d, got {item!r}")
    if "poly" in item and "bbox_2d" not in item:
        raise _LineError(
            f"{where}a poly geometry (CoordExp's polygon) is not read: stagectl trains boxes; give the object "
            "a bbox_2d (the polygon's bounding box) or leave it out"
        )
    _check_fields(item, OBJECT_FIELDS, where=where, optional=OBJECT_OPTIONAL)
    desc = item["desc"]
    if not isinstance(desc, str) or not desc.strip():
        raise _LineError(f"{where}desc must be a non-empty string, got {desc!r}")
    box = item["bbox_2d"]
    x1, y1, x2, y2 = values = _box_values(box, where)
    from_tokens = isinstance(box[0], str)  # `_box_values` allows one form per box
    if x2 < x1:
        raise _LineError(f"{where}bbox_2d {box} has x2 < x1")
    if y2 < y1:
        raise _LineError(f"{where}bbox_2d {box} has y2 < y1")
    category_id = _optional_id(item, "category_id", where)
    area = item.get("area")
    if area is not None and (not _is_number(area) or area < 0):
        raise _LineError(f"{where}area must be a non-negative number of pixels, got {area!r}")
    return _RawObject(
        desc=desc, box=values, category_id=category_id, from_tokens=from_tokens, area=_number(area)
    )


def _box_values(box: Any, where: str) -> tuple[float, float, float, float]:
    """The four coordinates of `bbox_2d`, written as numbers or as `<|coord_k|>` tokens (one form per box)."""
    shape = f"{where}bbox_2d must be 4 numbers [x1, y1, x2, y2] or 4 <|coord_k|> tokens, got {box!r}"
    if not isinstance(box, list) or len(box) != 4:
        raise _LineError(shape)
    if all(_is_number(v) for v in box):
        x1, y1, x2, y2 = (float(v) for v in box)
        return (x1, y1, x2, y2)
    if not all(isinstance(v, str) for v in box):
        if any(isinstance(v, str) and v.startswith("<|coord_") for v in box):
            raise _LineError(
                f"{where}bbox_2d {box!r} mixes numbers and <|coord_k|> tokens: write one form per box"
            )
        raise _LineError(shape)
    bins: list[float] = []
    for index, token in enumerate(box):
        match = COORD_TOKEN.match(token)
        if match is None or int(match.group(1)) > MAX_BIN:
            raise _LineError(
                f"{where}bbox_2d[{index}] {token!r} is not a coordinate token <|coord_k|> with k in 0..{MAX_BIN}"
            )
        bins.append(float(match.group(1)))
    return (bins[0], bins[1], bins[2], bins[3])


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def _fits_bins(box: tuple[float, float, float, float]) -> bool:
    return all(v.is_integer() and 0 <= v <= MAX_BIN for v in box)


def _fits_pixels(box: tuple[float, float, float, float], width: int, height: int) -> bool:
    x1, y1, x2, y2 = box
    return x1 >= 0 and y1 >= 0 and x2 <= width and y2 <= height


def _detect_box_format(raws: list[_RawSample]) -> Literal["pixel", "norm1000"]:
    """The `auto` rule: one format for the whole file, or an error when the file cannot tell."""
    boxes = [(obj.box, raw) for raw in raws for obj in raw.objects + raw.crowd]
    if not boxes:
        return "norm1000"  # nothing to convert
    if any(not _fits_bins(box) for box, _ in boxes):
        if all(v.is_integer() and 0 <= v <= MAX_BIN + 1 for box, _ in boxes for v in box):
            # nothing above 1000 and nothing fractional: a 0..1000 normalised scale (round(1000 * x / W))
            # as likely as pixels; read as pixels, every box would be silently shrunk on large images
            raise _LineError(
                f"box_format 'auto' cannot tell pixel boxes from a 0..{MAX_BIN + 1} normalised scale (every "
                f"coordinate is an integer, the largest is {MAX_BIN + 1}): set data.box_format: pixel if they are "
                f"pixels; a 0..{MAX_BIN + 1} scale must be rescaled to the norm-1000 bins 0..{MAX_BIN}"
            )
        return "pixel"
    if any(obj.from_tokens for raw in raws for obj in raw.objects + raw.crowd):
        return "norm1000"  # coordinate tokens are bins by definition
    if any(not _fits_pixels(box, raw.width, raw.height) for box, raw in boxes):
        return "norm1000"
    raise _LineError(
        "box_format 'auto' cannot tell pixel boxes from norm-1000 boxes (every box fits both): "
        "set data.box_format: pixel or norm1000"
    )


def _to_sample(raw: _RawSample, box_format: BoxFormat) -> DetectionSample:
    return DetectionSample(
        images=raw.images,
        width=raw.width,
        height=raw.height,
        objects=_to_objects(raw, raw.objects, "objects", box_format),
        image_id=raw.image_id,
        crowd=_to_objects(raw, raw.crowd, "crowd", box_format),
        line_no=raw.line_no,
    )


def _to_objects(
    raw: _RawSample, raw_objects: list[_RawObject], kind: str, box_format: BoxFormat
) -> list[DetObject]:
    """`raw_objects` (the line's `kind` list) with their boxes read as `box_format`, in norm-1000 bins."""
    objects: list[DetObject] = []
    for index, obj in enumerate(raw_objects):
        shown = [int(v) if v.is_integer() else v for v in obj.box]
        if box_format == "norm1000":
            if not _fits_bins(obj.box) and _fits_pixels(obj.box, raw.width, raw.height):
                raise _LineError(
                    f"{kind}[{index}]: bbox_2d {shown} is not a norm-1000 box (integers in 0..{MAX_BIN}) "
                    f"but fits the {raw.width}x{raw.height} image: these look like pixel boxes "
                    "(as `stagectl convert coco` writes them): set data.box_format: pixel"
                )
            if not _fits_bins(obj.box):
                raise _LineError(
                    f"{kind}[{index}]: bbox_2d {shown} is outside the image: "
                    f"norm-1000 boxes are integers in 0..{MAX_BIN}"
                )
            x1, y1, x2, y2 = (int(v) for v in obj.box)
            bins = (x1, y1, x2, y2)
        else:
            if obj.from_tokens:
                raise _LineError(
                    f"{kind}[{index}]: bbox_2d is written as <|coord_k|> tokens, which are norm-1000 bins, "
                    "but box_format is pixel: set data.box_format: norm1000 (or auto)"
                )
            if not _fits_pixels(obj.box, raw.width, raw.height):
                hint = (
                    ": these look like norm-1000 boxes (integers in 0..999, as `stagectl demo-data` writes "
                    "them): set data.box_format: norm1000"
                    if _fits_bins(obj.box)
                    else ""
                )
                raise _LineError(
                    f"{kind}[{index}]: bbox_2d {shown} is outside the {raw.width}x{raw.height} image{hint}"
                )
            bins = pixel_box_to_bins(obj.box, raw.width, raw.height)
        objects.append(DetObject(desc=obj.desc, bbox_2d=bins, category_id=obj.category_id, area=obj.area))
    return objects
