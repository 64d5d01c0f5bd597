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
What upstream's writers add besides (CoordExp's `summary` and `metadata`, its COCO converter's `file_name`,
`category_name`, `coco_ann_id`, `object_id`) is checked and not used (`stagectl.data.jsonl_line`); its `poly`
objects are a line error (boxes only). Blank lines are skipped, and so is a UTF-8 byte-order mark at the start
of the file; no other field is allowed.
Text that is not UTF-8, JSON nested too deeply, lone-surrogate escapes and a `desc` spelling a special token
(`<|im_end|>`, which a target would encode as that token) are line errors too.

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

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from stagectl.data.jsonl_line import ImageCheck, LineError, RawObject, RawSample, decode_line, parse_line
from stagectl.data.sample import DetectionSample, DetObject, pixel_box_to_bins
from stagectl.detection.coords import MAX_BIN
from stagectl.files import cwd_note

BoxFormat = Literal["pixel", "norm1000", "auto"]

MAX_REPORTED_ERRORS = 20
# how a detection JSONL that is not there is made (the loader's error and doctor's fix say it alike)
WRITE_JSONL_HINT = (
    "write it with `stagectl convert coco INSTANCES.json --images DIR --out {out}` (or `stagectl demo-data DIR` "
    "for the synthetic set)"
)


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


def load_jsonl_dataset(
    path: str | os.PathLike[str],
    image_root: str | os.PathLike[str] | None = None,
    *,
    box_format: BoxFormat = "norm1000",
    verify_images: bool = False,
) -> list[DetectionSample]:
    """Read and validate a detection JSONL file; boxes come back in norm-1000 bins."""
    path = Path(path)
    if path.is_dir():
        raise DataError([f"{path}: is a directory, not a JSONL file; name the file in it"])
    if not path.is_file():
        raise DataError([f"{path}: no such file{cwd_note(path)}; {WRITE_JSONL_HINT.format(out=path)}"])
    root = Path(image_root) if image_root is not None else path.parent
    root = Path(os.path.abspath(root))
    errors: list[tuple[int, str]] = []  # (line number, full message); 0 for file-level problems
    raws: list[RawSample] = []
    seen_images: dict[str, ImageCheck] = {}  # absolute path -> what is wrong with it, its size
    with path.open("rb") as handle:
        for line_no, raw_line in enumerate(handle, start=1):
            try:
                line = decode_line(raw_line, line_no)
                if not line.strip():
                    continue
                raws.append(parse_line(line, line_no, root, seen_images, verify_images))
            except LineError as exc:
                errors.append((line_no, f"{path}:{line_no}: {exc}"))
    if not raws and not errors:
        raise DataError([f"{path}: no samples"])

    samples: list[DetectionSample] = []
    try:
        resolved = _detect_box_format(raws) if box_format == "auto" else box_format
    except LineError as exc:
        errors.append((0, f"{path}: {exc}"))
    else:
        for raw in raws:
            try:
                samples.append(_to_sample(raw, resolved))
            except LineError as exc:
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
    # every coordinate an integer up to 1000 and some 1000: pixels, or a 0..1000 normalised scale (not bins)
    scale_1000: bool = False
    num_boxes: int = 0  # objects and crowd regions of the lines that parse; 0: nothing to read


def read_box_format(
    path: str | os.PathLike[str], image_root: str | os.PathLike[str] | None = None
) -> BoxReading:
    """What `box_format: auto` makes of the file's boxes (lines that do not parse are left out; the loader
    reports them), and how many boxes fit neither reading (a typo such as 1000 in a norm-1000 file makes
    `auto` say pixel, but switching to pixel would not load them either)."""
    path = Path(path)
    root = Path(os.path.abspath(Path(image_root) if image_root is not None else path.parent))
    raws: list[RawSample] = []
    seen_images: dict[str, ImageCheck] = {}
    with path.open("rb") as handle:
        for line_no, raw_line in enumerate(handle, start=1):
            try:
                line = decode_line(raw_line, line_no)
                if line.strip():
                    raws.append(parse_line(line, line_no, root, seen_images, False))
            except LineError:
                continue  # counted and reported by `load_jsonl_dataset`
    boxes = [(obj.box, raw) for raw in raws for obj in raw.objects + raw.crowd]
    num_fit_neither = sum(
        not _fits_bins(box) and not _fits_pixels(box, raw.width, raw.height) for box, raw in boxes
    )
    try:
        return BoxReading(_detect_box_format(raws), num_fit_neither, num_boxes=len(boxes))
    except LineError as exc:
        return BoxReading(
            None, num_fit_neither, undecided=str(exc), scale_1000=_scale_1000(boxes), num_boxes=len(boxes)
        )


def _scale_1000(boxes: list[tuple[tuple[float, float, float, float], RawSample]]) -> bool:
    """Some coordinate is 1000 and every one is an integer up to 1000: pixels or a 0..1000 scale, never bins."""
    values = [v for box, _ in boxes for v in box]
    return any(v == MAX_BIN + 1 for v in values) and all(
        v.is_integer() and 0 <= v <= MAX_BIN + 1 for v in values
    )


def _fits_bins(box: tuple[float, float, float, float]) -> bool:
    return all(v.is_integer() and 0 <= v <= MAX_BIN for v in box)


def _fits_pixels(box: tuple[float, float, float, float], width: int, height: int) -> bool:
    x1, y1, x2, y2 = box
    return x1 >= 0 and y1 >= 0 and x2 <= width and y2 <= height


def _detect_box_format(raws: list[RawSample]) -> Literal["pixel", "norm1000"]:
    """The `auto` rule: one format for the whole file, or an error when the file cannot tell."""
    boxes = [(obj.box, raw) for raw in raws for obj in raw.objects + raw.crowd]
    if not boxes:
        return "norm1000"  # nothing to convert
    if any(not _fits_bins(box) for box, _ in boxes):
        if _scale_1000(boxes):
            # nothing above 1000 and nothing fractional: a 0..1000 normalised scale (round(1000 * x / W))
            # as likely as pixels; read as pixels, every box would be silently shrunk on large images
            raise LineError(
                f"box_format 'auto' cannot tell pixel boxes from a 0..{MAX_BIN + 1} normalised scale (every "
                f"coordinate is an integer, the largest is {MAX_BIN + 1}): set data.box_format: pixel if they are "
                f"pixels; a 0..{MAX_BIN + 1} scale must be rescaled to the norm-1000 bins 0..{MAX_BIN}"
            )
        return "pixel"
    if any(obj.from_tokens for raw in raws for obj in raw.objects + raw.crowd):
        return "norm1000"  # coordinate tokens are bins by definition
    if any(not _fits_pixels(box, raw.width, raw.height) for box, raw in boxes):
        return "norm1000"
    raise LineError(
        "box_format 'auto' cannot tell pixel boxes from norm-1000 boxes (every box fits both): "
        "set data.box_format: pixel or norm1000"
    )


def _to_sample(raw: RawSample, box_format: BoxFormat) -> DetectionSample:
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
    raw: RawSample, raw_objects: list[RawObject], kind: str, box_format: BoxFormat
) -> list[DetObject]:
    """`raw_objects` (the line's `kind` list) with their boxes read as `box_format`, in norm-1000 bins."""
    objects: list[DetObject] = []
    for index, obj in enumerate(raw_objects):
        shown = [int(v) if v.is_integer() else v for v in obj.box]
        if box_format == "norm1000":
            if not _fits_bins(obj.box) and _fits_pixels(obj.box, raw.width, raw.height):
                raise LineError(
                    f"{kind}[{index}]: bbox_2d {shown} is not a norm-1000 box (integers in 0..{MAX_BIN}) "
                    f"but fits the {raw.width}x{raw.height} image: these look like pixel boxes "
                    "(as `stagectl convert coco` writes them): set data.box_format: pixel"
                )
            if not _fits_bins(obj.box):
                raise LineError(
                    f"{kind}[{index}]: bbox_2d {shown} is outside the image: "
                    f"norm-1000 boxes are integers in 0..{MAX_BIN}"
                )
            x1, y1, x2, y2 = (int(v) for v in obj.box)
            bins = (x1, y1, x2, y2)
        else:
            if obj.from_tokens:
                raise LineError(
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
                raise LineError(
                    f"{kind}[{index}]: bbox_2d {shown} is outside the {raw.width}x{raw.height} image{hint}"
                )
            bins = pixel_box_to_bins(obj.box, raw.width, raw.height)
        objects.append(DetObject(desc=obj.desc, bbox_2d=bins, category_id=obj.category_id, area=obj.area))
    return objects
