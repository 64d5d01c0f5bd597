"""The synthetic shapes data set: min_objects..max_objects (default 1) coloured shapes per image with exact boxes
(docs/design.md#running-offline).

Each image is a plain dark background with non-overlapping circles, squares and triangles in red,
green, blue or yellow; the desc is "<colour> <shape>". Shape sides are drawn uniformly from
`side_fraction` (as fractions of the image side; default 0.15-0.35). Shapes are drawn without anti-aliasing and never
touch (a 2-pixel gap between their placement boxes), so every object is fully visible and its box is
*measured* from the drawn pixels: the tightest box around exactly that shape's pixels.

Everything is a pure function of `(seed, split, index, image_size, max_objects, side_fraction, min_objects)`: sample `i` uses its
own `random.Random` seeded by a string, so it is the same on every machine and Python run, independent
of `num_samples`. The `eval` split uses a different stream of the same seed, so train and eval never
share a scene by construction.

`generate_synthetic` always writes to a directory (the learner and the rollout server both need image
paths): `images/<split>_NNNNNN.png`, `<split>.jsonl` (norm-1000 boxes, image paths relative to the
directory) and `<split>.manifest.json` (the parameters, written last, marks a complete split). A call
whose manifest already matches loads the existing files instead of drawing again; every file is
written to a temporary name and renamed, so ranks generating the same cache directory at once are safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from PIL import Image, ImageDraw

from stagectl.cache import cache_root
from stagectl.data.jsonl import load_jsonl_dataset
from stagectl.data.sample import DetectionSample, DetObject, pixel_box_to_bins
from stagectl.files import atomic_write_text, host_tag
from stagectl.watchdog import pid_alive

Split = Literal["train", "eval"]

GENERATOR_VERSION = 1  # bump when drawing changes, so cached data sets are regenerated
SHAPES = ("circle", "square", "triangle")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (50, 90, 230),
    "yellow": (235, 205, 35),
}
BACKGROUND = (32, 32, 32)
MIN_IMAGE_SIZE = 28
MIN_SIDE_FRACTION = 0.15  # default shape side range, as fractions of the image side
MAX_SIDE_FRACTION = 0.35
SideFraction = tuple[float, float]
DEFAULT_SIDE_FRACTION: SideFraction = (MIN_SIDE_FRACTION, MAX_SIDE_FRACTION)
SIDE_FRACTION_LIMITS = (0.05, 0.9)
GAP_PX = 2  # free pixels between two shapes' placement boxes
PLACEMENT_TRIES = 100


@dataclass(frozen=True)
class PlacedShape:
    """A shape to draw: kind, colour name and the inclusive pixel square it is drawn in."""

    kind: str
    color: str
    x0: int
    y0: int
    side: int


def plan_scene(
    rng: random.Random,
    image_size: int,
    max_objects: int,
    side_fraction: SideFraction = DEFAULT_SIDE_FRACTION,
    min_objects: int = 1,
) -> list[PlacedShape]:
    """Pick min_objects..max_objects shapes and non-overlapping places for them (a shape that finds no
    free place in `PLACEMENT_TRIES` tries is left out, so a crowded scene may hold fewer)."""
    min_side = max(4, round(side_fraction[0] * image_size))
    max_side = max(min_side, round(side_fraction[1] * image_size))
    placed: list[PlacedShape] = []
    for _ in range(rng.randint(min_objects, max_objects)):
        kind = rng.choice(SHAPES)
        color = rng.choice(list(COLORS))
        side = rng.randint(min_side, max_side)
        for _ in range(PLACEMENT_TRIES):
            x0 = rng.randint(0, image_size - side)
            y0 = rng.randint(0, image_size - side)
            if not any(_too_close(x0, y0, side, other) for other in placed):
                placed.append(PlacedShape(kind=kind, color=color, x0=x0, y0=y0, side=side))
                break
    return placed


def _too_close(x0: int, y0: int, side: int, other: PlacedShape) -> bool:
    """Whether two placement squares come within `GAP_PX` of each other."""
    apart_x = x0 + side + GAP_PX <= other.x0 or other.x0 + other.side + GAP_PX <= x0
    apart_y = y0 + side + GAP_PX <= other.y0 or other.y0 + other.side + GAP_PX <= y0
    return not (apart_x or apart_y)


def render_scene(shapes: list[PlacedShape], image_size: int) -> tuple[Image.Image, list[DetObject]]:
    """Draw the shapes; each object's box is the tight box of its own drawn pixels, in norm-1000 bins.
    Objects come sorted top-to-bottom, then left-to-right."""
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    measured: list[tuple[tuple[int, int, int, int], str]] = []
    for shape in shapes:
        mask = Image.new("L", (image_size, image_size), 0)
        _draw_shape(ImageDraw.Draw(mask), shape)
        image.paste(COLORS[shape.color], mask=mask)
        left, top, right, bottom = mask.getbbox() or (0, 0, 1, 1)  # a shape always draws pixels
        measured.append(((left, top, right - 1, bottom - 1), f"{shape.color} {shape.kind}"))
    measured.sort(key=lambda item: (item[0][1], item[0][0]))
    objects = [
        DetObject(desc=desc, bbox_2d=pixel_box_to_bins(box, image_size, image_size)) for box, desc in measured
    ]
    return image, objects


def _draw_shape(draw: ImageDraw.ImageDraw, shape: PlacedShape) -> None:
    x0, y0 = shape.x0, shape.y0
    x1, y1 = x0 + shape.side - 1, y0 + shape.side - 1  # inclusive corners
    if shape.kind == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=255)
    elif shape.kind == "square":
        draw.rectangle((x0, y0, x1, y1), fill=255)
    elif shape.kind == "triangle":
        draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=255)
    else:
        raise AssertionError(f"unknown shape kind {shape.kind!r}")


def synthetic_scene(
    seed: int,
    split: Split,
    index: int,
    image_size: int = 112,
    max_objects: int = 4,
    side_fraction: SideFraction = DEFAULT_SIDE_FRACTION,
    min_objects: int = 1,
) -> tuple[Image.Image, list[DetObject]]:
    """Sample `index` of a synthetic split, in memory."""
    rng = random.Random(f"stagectl-synthetic/v{GENERATOR_VERSION}/{split}/{seed}/{index}")
    return render_scene(plan_scene(rng, image_size, max_objects, side_fraction, min_objects), image_size)


def check_side_fraction(side_fraction: SideFraction) -> None:
    """`ValueError` unless `low <= high` and both lie in `SIDE_FRACTION_LIMITS`."""
    low, high = side_fraction
    lo_limit, hi_limit = SIDE_FRACTION_LIMITS
    if not (lo_limit <= low <= high <= hi_limit):
        raise ValueError(
            f"side_fraction must be (low, high) with {lo_limit} <= low <= high <= {hi_limit}, got {side_fraction}"
        )


def synthetic_params(
    num_samples: int,
    seed: int,
    image_size: int = 112,
    max_objects: int = 4,
    split: Split = "train",
    side_fraction: SideFraction = DEFAULT_SIDE_FRACTION,
    min_objects: int = 1,
) -> dict[str, Any]:
    """The parameters that fully determine a split (checked, and recorded in its manifest; `min_objects`
    only when it is not 1, so the splits drawn before it existed keep their cache keys)."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}")
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be at least {MIN_IMAGE_SIZE} pixels, got {image_size}")
    if not 1 <= max_objects <= 8:
        raise ValueError(f"max_objects must be in 1..8, got {max_objects}")
    if not 1 <= min_objects <= max_objects:
        raise ValueError(f"min_objects must be in 1..max_objects ({max_objects}), got {min_objects}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    check_side_fraction(side_fraction)
    return {
        "generator_version": GENERATOR_VERSION,
        "num_samples": num_samples,
        "seed": seed,
        "image_size": image_size,
        "max_objects": max_objects,
        "split": split,
        "side_fraction": [float(side_fraction[0]), float(side_fraction[1])],
        **({"min_objects": min_objects} if min_objects != 1 else {}),
    }


def default_synthetic_dir(params: dict[str, Any]) -> Path:
    """`$STAGECTL_CACHE_DIR/data/synthetic-<hash of params>` (cache root defaults to ~/.cache/stagectl)."""
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "data" / f"synthetic-{digest}"


def generate_synthetic(
    num_samples: int,
    seed: int,
    out_dir: str | os.PathLike[str] | None = None,
    image_size: int = 112,
    *,
    max_objects: int = 4,
    split: Split = "train",
    side_fraction: SideFraction = DEFAULT_SIDE_FRACTION,
    min_objects: int = 1,
) -> list[DetectionSample]:
    """Write (or reuse) a synthetic split under `out_dir` (default: a cache dir keyed by the parameters)
    and return its samples with absolute image paths."""
    params = synthetic_params(num_samples, seed, image_size, max_objects, split, side_fraction, min_objects)
    out = Path(os.path.abspath(out_dir)) if out_dir is not None else default_synthetic_dir(params)
    jsonl_path = out / f"{split}.jsonl"
    manifest_path = out / f"{split}.manifest.json"
    previous = _read_manifest(manifest_path)
    if jsonl_path.is_file() and previous == params:
        return load_jsonl_dataset(jsonl_path, box_format="norm1000")

    stale = jsonl_path.exists() or previous is not None  # another data set's files, read at the start
    (out / "images").mkdir(parents=True, exist_ok=True)
    _remove_orphans(out / "images", split)
    samples: list[DetectionSample] = []
    lines: list[str] = []
    staged: list[tuple[Path, Path]] = []  # (temp file, image path): drawn whole before any image is replaced
    try:
        for index in range(num_samples):
            image, objects = synthetic_scene(
                seed, split, index, image_size, max_objects, side_fraction, min_objects
            )
            relative = f"images/{split}_{index:06d}.png"
            staged.append((_staged_png(image, out / relative), out / relative))
            sample = DetectionSample(
                images=[str(out / relative)], width=image_size, height=image_size, objects=objects
            )
            samples.append(sample)
            lines.append(json.dumps({**sample.to_json_dict(), "images": [relative]}))
        if stale:  # the old JSONL would name the new images from here on: gone until the new one is in
            manifest_path.unlink(missing_ok=True)
            jsonl_path.unlink(missing_ok=True)
        while staged:
            os.replace(*staged[-1])
            staged.pop()
    finally:  # an error (or Ctrl-C) while drawing: the earlier data set is left as it was
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    atomic_write_text(jsonl_path, "".join(line + "\n" for line in lines))
    atomic_write_text(manifest_path, json.dumps(params, sort_keys=True, indent=2) + "\n")
    if previous is not None:  # a larger split drawn here before: its images past this one's are stale
        _remove_images(out, split, range(num_samples, int(previous.get("num_samples", 0))))
    return samples


def remove_synthetic_split(out_dir: str | os.PathLike[str], split: Split) -> bool:
    """Remove a split `generate_synthetic` wrote into `out_dir` (its JSONL, manifest and images; nothing
    without its manifest). Returns whether there was one."""
    out = Path(out_dir)
    manifest_path = out / f"{split}.manifest.json"
    manifest = _read_manifest(manifest_path)
    if manifest is None:
        return False
    _remove_images(out, split, range(int(manifest.get("num_samples", 0))))
    (out / f"{split}.jsonl").unlink(missing_ok=True)
    manifest_path.unlink()
    return True


def _remove_images(out: Path, split: Split, indices: range) -> None:
    for index in indices:
        (out / f"images/{split}_{index:06d}.png").unlink(missing_ok=True)


def _read_manifest(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None  # a damaged manifest means "not generated": draw again
    return manifest if isinstance(manifest, dict) else None


def _temporary_name(path: Path) -> Path:
    """`.NAME.<pid>-<host>.tmp`: the host too, as the cache may be one filesystem shared by several nodes."""
    return path.with_name(f".{path.name}.{os.getpid()}-{host_tag()}.tmp")


def _remove_orphans(images: Path, split: Split) -> None:
    """The temp images of a draw that was killed (its process gone); a live one's (another rank drawing the
    same cached split) are left to it."""
    host = host_tag()  # another host's draw (a shared cache) has a pid that says nothing here: left to it
    for tmp in images.glob(f".{split}_*.png.*.tmp"):
        pid, _, tag = tmp.name.rsplit(".", 2)[-2].partition("-")
        if pid.isdigit() and tag == host and not pid_alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _staged_png(image: Image.Image, path: Path) -> Path:
    """`image` saved whole to a temp file next to `path`, for the caller to rename over it."""
    tmp = _temporary_name(path)
    try:
        image.save(tmp, format="PNG")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp
