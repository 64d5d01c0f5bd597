"""`stagectl convert coco`: a COCO instances file (COCO, LVIS, Objects365 exports) -> the detection JSONL.

What goes where:
- each entry of `images` is one JSONL line: `images: [path]` (the image's file under `--images`, written
  relative to the output file's directory, which is where the loader looks by default), COCO's `width` /
  `height` (images are stat-ed, never opened), and the COCO `id` as `image_id`. An image without
  `file_name` (LVIS v1) uses the last two parts of its `coco_url` (`val2017/000000397133.jpg`), as
  detectron2 does.
- each annotation becomes an object of its image, in file order: `desc` is its category's `name` as is,
  `category_id` its COCO category id (ids need not be contiguous), and `bbox_2d` the COCO `[x, y, w, h]`
  as pixel corners `[x, y, x + w, y + h]` (floats rounded to 1e-6 px). Train with `data.box_format: pixel`:
  the loader turns them into norm-1000 bins, and the ids let predictions go back in COCO's own ids.
  COCO's `area` (the mask's, in COCO's own files) is kept when the annotation has one: the eval's
  small / medium / large buckets use it as the official evaluation does (without it: the box's area).
- `iscrowd: 1` annotations (a missing `iscrowd`, as in LVIS, means 0) go to the line's `crowd` list, not
  its objects, written like an object and counted: never trained on, they are the eval's crowd regions,
  where COCOeval ignores predictions instead of counting false positives (as the official evaluation does).
- left out and counted: boxes of zero width or height, in pixels or once on the loader's norm-1000 grid
  (`coco_boxes`), and boxes wholly outside their image (crowd regions too); a box partly outside is clamped
  to `[0, W] x [0, H]` (COCO's right edge `x + w == W` is the loader's accepted `x2 == width`) and counted.
- images left with no object are kept as empty samples (negatives), or left out with `drop_empty`.

Problems of the file (a missing image file, a duplicate image or category id, one image file under two
image ids, an annotation naming an unknown image or category, a malformed entry) are collected over the whole file, one per entry, and raised
together as one `CocoError` (an annotation of an image or category whose own entry is bad is not reported
again); nothing is written then. `convert_instances` is the pure core (the image
check is passed in); `convert_coco_file` reads, converts and writes atomically.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagectl.data.coco_boxes import CocoStats, clip_box, tidy
from stagectl.data.jsonl import MAX_REPORTED_ERRORS
from stagectl.detection.entries import spells_special_token
from stagectl.files import atomic_write_lines, check_output_dir

PROGRESS_EVERY = 1000  # annotations between two progress callbacks


class CocoError(ValueError):
    """A COCO file that cannot be converted. `errors` holds one `file: where: what is wrong` entry per
    problem (at most `MAX_REPORTED_ERRORS`); `num_errors` counts all of them."""

    def __init__(self, errors: list[str], num_errors: int | None = None) -> None:
        self.errors = list(errors)
        self.num_errors = len(errors) if num_errors is None else num_errors
        message = "\n".join(self.errors)
        if self.num_errors > len(self.errors):
            message += f"\n... and {self.num_errors - len(self.errors)} more problems"
        super().__init__(message)


class _EntryError(Exception):
    """A problem with one entry of the file; collected by the converter."""


@dataclass(frozen=True)
class _Image:
    path: str  # as written in the JSONL
    width: int
    height: int


def convert_instances(
    instances: Any,
    image_dir: Path,
    out_dir: Path,
    *,
    source: str,
    image_exists: Callable[[str], bool] | None = None,
    drop_empty: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[list[dict[str, Any]], CocoStats]:
    """The JSONL lines of a parsed COCO instances file, in `images` order, and the stats.

    `image_exists(absolute_path)` checks each image file (None: not checked); `on_progress(done, total)`
    follows the annotations. Raises `CocoError` listing every problem of the file."""
    errors: list[str] = []
    top = _top_level(instances)
    if isinstance(top, str):
        raise CocoError([f"{source}: {top}"])
    categories_raw, images_raw, annotations_raw = top

    # ids of entries reported as bad: annotations naming them are not reported again
    bad_ids: set[tuple[str, int | None]] = set()
    categories: dict[int, str] = {}
    names: dict[str, int] = {}
    for index, item in enumerate(categories_raw):
        try:
            cat_id, name = _category(item, index, categories, names)
        except _EntryError as exc:
            errors.append(f"{source}: {exc}")
            bad_ids.add(("category", _entry_id(item)))
            continue
        categories[cat_id] = name
        names[name] = cat_id

    images: dict[int, _Image] = {}
    id_of_path: dict[str, int] = {}  # an image file is one image: two ids for it is a broken export
    missing: list[str] = []
    for index, item in enumerate(images_raw):
        try:
            image_id, image = _image(item, index, images, image_dir, out_dir, image_exists, missing)
            if image.path in id_of_path:
                raise _EntryError(
                    f"{_Where('images', index, item)}: file_name {item.get('file_name', image.path)!r} is also "
                    f"image id {id_of_path[image.path]}'s; one image file must be one image (COCO tools "
                    "would score its two ids as two images)"
                )
        except _EntryError as exc:
            errors.append(f"{source}: {exc}")
            bad_ids.add(("image", _entry_id(item)))
            continue
        images[image_id] = image
        id_of_path[image.path] = image_id
    if image_exists is not None and len(missing) > 1 and len(missing) == len(images_raw):
        errors.insert(0, f"{source}: none of the {len(missing)} image files is under --images {image_dir}")

    if not images_raw:
        errors.append(f"{source}: 'images' is empty: nothing to convert")
    stats = CocoStats(num_categories=len(categories))
    objects: dict[int, list[dict[str, Any]]] = {image_id: [] for image_id in images}
    crowds: dict[int, list[dict[str, Any]]] = {image_id: [] for image_id in images}
    total = len(annotations_raw)
    for index, item in enumerate(annotations_raw):
        if on_progress is not None and index % PROGRESS_EVERY == 0:
            on_progress(index, total)
        try:
            _annotation(item, index, images, categories, objects, crowds, stats, bad_ids)
        except _EntryError as exc:
            errors.append(f"{source}: {exc}")
    if on_progress is not None:
        on_progress(total, total)
    if errors:
        raise CocoError(errors[:MAX_REPORTED_ERRORS], num_errors=len(errors))

    lines: list[dict[str, Any]] = []
    for image_id, image in images.items():
        image_objects = objects[image_id]
        if not image_objects and drop_empty:
            stats.num_dropped_empty += 1
            stats.num_crowd -= len(crowds[image_id])  # left out with its image: not written
            continue
        stats.num_empty += not image_objects
        line: dict[str, Any] = {
            "images": [image.path],
            "width": image.width,
            "height": image.height,
            "objects": image_objects,
            "image_id": image_id,
        }
        if crowds[image_id]:
            line["crowd"] = crowds[image_id]
        lines.append(line)
    stats.num_images = len(lines)
    if not lines:
        raise CocoError([f"{source}: every image is without objects and --drop-empty leaves out all of them"])
    return lines, stats


def _top_level(instances: Any) -> tuple[list[Any], list[Any], list[Any]] | str:
    """The three lists of an instances file, or what is wrong with the file as a whole."""
    if not isinstance(instances, dict):
        return f"a COCO instances file is a JSON object, got {type(instances).__name__}"
    wrong = [
        key for key in ("images", "annotations", "categories") if not isinstance(instances.get(key), list)
    ]
    if wrong:
        hint = (
            " (an image_info file has no annotations: it cannot be trained on)"
            if wrong == ["annotations"]
            else ""
        )
        return f"not a COCO instances file: {', '.join(repr(k) for k in wrong)} must be lists{hint}"
    return instances["categories"], instances["images"], instances["annotations"]


def _entry_id(item: Any) -> int | None:
    entry_id = item.get("id") if isinstance(item, dict) else None
    return entry_id if isinstance(entry_id, int) and not isinstance(entry_id, bool) else None


class _Where:
    """`annotations[12] (id 345)`, formatted only when a message needs it (most entries are fine)."""

    __slots__ = ("index", "item", "kind")

    def __init__(self, kind: str, index: int, item: Any) -> None:
        self.kind, self.index, self.item = kind, index, item

    def __str__(self) -> str:
        entry_id = _entry_id(self.item)
        return f"{self.kind}[{self.index}]" + (f" (id {entry_id})" if entry_id is not None else "")


def _category(item: Any, index: int, seen: dict[int, str], names: dict[str, int]) -> tuple[int, str]:
    where = _Where("categories", index, item)
    if not isinstance(item, dict):
        raise _EntryError(f"{where}: must be an object with id and name, got {item!r}")
    cat_id = _id(item, "id", where)
    name = item.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _EntryError(f"{where}: name must be a non-empty string, got {name!r}")
    if spells_special_token(name):
        raise _EntryError(f"{where}: name {name!r} spells a special token (<|...|>), which cannot be a desc")
    if cat_id in seen:
        raise _EntryError(f"{where}: duplicate category id {cat_id} (also {seen[cat_id]!r})")
    if name in names:
        raise _EntryError(
            f"{where}: name {name!r} is also category id {names[name]}'s; a desc must name one category"
        )
    return cat_id, name


def _image(
    item: Any,
    index: int,
    seen: dict[int, _Image],
    image_dir: Path,
    out_dir: Path,
    image_exists: Callable[[str], bool] | None,
    missing: list[str],
) -> tuple[int, _Image]:
    where = _Where("images", index, item)
    if not isinstance(item, dict):
        raise _EntryError(f"{where}: must be an object with id, file_name, width, height, got {item!r}")
    image_id = _id(item, "id", where)
    if image_id in seen:
        raise _EntryError(f"{where}: duplicate image id {image_id}")
    name = item.get("file_name")
    if name is None and isinstance(item.get("coco_url"), str):  # LVIS v1: split folder + file of the URL
        name = "/".join(item["coco_url"].split("/")[-2:])
    if not isinstance(name, str) or not name or "\0" in name:
        raise _EntryError(f"{where}: file_name must be a non-empty path string, got {name!r}")
    width = _size(item, "width", where)
    height = _size(item, "height", where)
    full = os.path.abspath(os.path.join(image_dir, name))
    if image_exists is not None and not image_exists(full):
        missing.append(full)
        raise _EntryError(f"{where}: image file not found: {full}")
    return image_id, _Image(path=os.path.relpath(full, out_dir), width=width, height=height)


def _annotation(
    item: Any,
    index: int,
    images: dict[int, _Image],
    categories: dict[int, str],
    objects: dict[int, list[dict[str, Any]]],
    crowds: dict[int, list[dict[str, Any]]],
    stats: CocoStats,
    bad_ids: set[tuple[str, int | None]],
) -> None:
    """Check one annotation and add its object to `objects`, or to `crowds` when it is a crowd region (or
    count why it is left out)."""
    where = _Where("annotations", index, item)
    if not isinstance(item, dict):
        raise _EntryError(f"{where}: must be an object with image_id, category_id, bbox, got {item!r}")
    image_id = _id(item, "image_id", where)
    cat_id = _id(item, "category_id", where)
    bbox = item.get("bbox")
    if not isinstance(bbox, list) or len(bbox) != 4 or not all(_is_number(v) for v in bbox):
        raise _EntryError(f"{where}: bbox must be 4 finite numbers [x, y, w, h], got {bbox!r}")
    crowd = item.get("iscrowd", 0)
    if crowd not in (0, 1) or isinstance(crowd, float):
        raise _EntryError(f"{where}: iscrowd must be 0 or 1, got {crowd!r}")
    area = item.get("area")
    if area is not None and (not _is_number(area) or area < 0):
        raise _EntryError(f"{where}: area must be a non-negative number of pixels, got {area!r}")
    if ("image", image_id) in bad_ids or ("category", cat_id) in bad_ids:
        return  # its image or category entry is already reported
    image = images.get(image_id)
    if image is None:
        raise _EntryError(f"{where}: image_id {image_id} is not in images")
    if cat_id not in categories:
        raise _EntryError(f"{where}: category_id {cat_id} is not in categories")
    x, y, w, h = (float(v) for v in bbox)
    box, outcome = clip_box((x, y, w, h), image.width, image.height)
    if box is None:
        if outcome == "zero_area":
            stats.num_zero_area += 1
        elif outcome == "zero_on_grid":
            stats.num_zero_on_grid += 1
        else:
            stats.num_outside += 1
        return
    record: dict[str, Any] = {"desc": categories[cat_id], "bbox_2d": list(box), "category_id": cat_id}
    if area is not None:
        record["area"] = tidy(float(area))
    if crowd:
        stats.num_crowd += 1
        crowds[image_id].append(record)
        return
    stats.num_clamped += outcome == "clamped"
    stats.num_objects += 1
    stats.class_counts[categories[cat_id]] += 1
    objects[image_id].append(record)


def _id(item: dict[str, Any], key: str, where: _Where) -> int:
    value = item.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _EntryError(f"{where}: {key} must be a non-negative integer, got {value!r}")
    return value


def _size(item: dict[str, Any], key: str, where: _Where) -> int:
    value = item.get(key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # some exports write 640.0
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _EntryError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _is_number(value: Any) -> bool:
    kind = type(value)  # not isinstance: a bool is an int
    return kind is int or (kind is float and math.isfinite(value))


def read_instances(path: Path) -> Any:
    """The parsed JSON of an instances file; a missing or malformed file is a one-line `CocoError`."""
    try:
        with path.open("rb") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise CocoError([f"{path}: no such file"]) from None
    except IsADirectoryError:
        raise CocoError([f"{path}: is a directory, not an instances JSON file"]) from None
    except OSError as exc:
        raise CocoError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    except json.JSONDecodeError as exc:
        raise CocoError(
            [f"{path}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"]
        ) from None
    except (UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise CocoError([f"{path}: not valid JSON: {str(exc) or type(exc).__name__}"]) from None


def check_out(out: Path, instances_json: Path) -> None:
    """`CocoError` when `out` cannot be written as the JSONL: a directory, under a file, or the instances file
    itself (it would be replaced)."""
    if out.is_dir():
        raise CocoError(
            [f"--out {out}: cannot write: it is a directory; give the path of the JSONL file to write"]
        )
    if out.exists() and instances_json.exists() and os.path.samefile(out, instances_json):
        raise CocoError(
            [f"--out {out}: is the instances file itself, which it would replace; choose another path"]
        )
    try:
        check_output_dir(out.parent, key="--out")
    except ValueError as exc:
        raise CocoError([str(exc)]) from None


def convert_coco_file(
    instances_json: Path,
    image_dir: Path,
    out: Path,
    *,
    check_images: bool = True,
    drop_empty: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
) -> CocoStats:
    """Read `instances_json`, convert it and write `out` whole (a temp file renamed), or raise `CocoError`
    and write nothing."""
    if check_images and not image_dir.is_dir():
        raise CocoError([f"--images {image_dir}: no such directory"])
    check_out(out, instances_json)  # before the read: an LVIS train file takes minutes to parse
    instances = read_instances(instances_json)
    out_dir = Path(os.path.abspath(out)).parent
    lines, stats = convert_instances(
        instances,
        image_dir,
        out_dir,
        source=str(instances_json),
        image_exists=os.path.isfile if check_images else None,
        drop_empty=drop_empty,
        on_progress=on_progress,
    )
    del instances  # the parsed file can be GBs (LVIS train); free it before writing
    atomic_write_lines(out, (json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    return stats
