"""The prediction gallery of `stagectl eval`: images with the ground truth and the predictions drawn, worst
first, written to `DIR/gallery/` (one PNG per image, `gallery.json`, `index.html`).

Each object is marked by the matching the metrics use (`detection.judge.match_objects` at the eval IoU gate,
`detection.dedup.find_duplicates` at `channel_b.duplicate_iou_threshold`), never a second one:

    ground truth  matched  green, solid, thin        missed     orange, dashed, thick
    prediction    matched  blue, solid, "desc score IoU"
                  false positive  red, dashed        duplicate  magenta, dotted (an unmatched repeat)

"Worst" is most misses + false positives (ties: image order); only images with at least one are drawn, so a
perfect eval draws none and its index page says so. An image is named by what the data calls it: its COCO
`image_id` when it has one and its file name (`003_id139_000000000139.png`: worst-first rank, id, file stem);
`gallery.json` keeps its position in the evaluated set (`index`) too. Images are scaled for display so the
longer side is within [`MIN_SIDE`, `MAX_SIDE`] px; boxes are decoded from bins on the sample's own width/height and scaled
with the image, so they stay where they are. The Channel-B gallery (`learner/channel_b/gallery.py`) draws with the same `draw`.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from PIL import Image, ImageDraw, ImageFont

from stagectl.config.plan import MatchCosts
from stagectl.data.sample import DetectionSample, bins_to_pixel_box
from stagectl.detection.dedup import find_duplicates
from stagectl.detection.judge import match_objects

if TYPE_CHECKING:
    from stagectl.evaluation.core import ImageOutcome

GALLERY_DIR = "gallery"
GALLERY_JSON = "gallery.json"
INDEX_HTML = "index.html"
DEFAULT_GALLERY_IMAGES = 24  # `stagectl eval --gallery N`
MAX_SIDE = 640  # display size: the longer side of a drawn image is at most this (px) ...
MIN_SIDE = 320  # ... and at least this
MAX_LISTED_BOXES = 100  # the pages list at most this many of an image's boxes as text (all: gallery.json)

Verdict = Literal["matched", "missed", "false_positive", "duplicate"]
Rgb = tuple[int, int, int]


@dataclass(frozen=True)
class BoxStyle:
    colour: Rgb
    width: int
    dash: tuple[int, int] | None  # (on, off) px; None: solid


# (is a prediction, verdict) -> style; every pair is distinct in colour and the kinds also in line style
STYLES: dict[tuple[bool, str], BoxStyle] = {
    (False, "matched"): BoxStyle((0, 170, 0), 2, None),
    (False, "missed"): BoxStyle((255, 140, 0), 3, (8, 4)),
    (True, "matched"): BoxStyle((30, 90, 255), 2, None),
    (True, "false_positive"): BoxStyle((230, 0, 0), 2, (6, 4)),
    (True, "duplicate"): BoxStyle((200, 0, 200), 2, (2, 3)),
}


@dataclass(frozen=True)
class DrawnBox:
    """One object to draw: its box in the sample's pixel frame, what it is and its caption."""

    box_px: tuple[float, float, float, float]  # x1, y1, x2, y2 on the sample's width x height
    is_pred: bool
    verdict: str
    label: str


@dataclass(frozen=True)
class _Pred:
    desc: str
    bbox_2d: tuple[int, int, int, int]


@dataclass(frozen=True)
class ImageVerdicts:
    boxes: list[DrawnBox]
    num_missed: int
    num_fp: int  # unmatched predictions, duplicates included

    @property
    def badness(self) -> int:
        return self.num_missed + self.num_fp


def judge_for_gallery(
    sample: DetectionSample, parsed: Sequence[dict[str, Any]], *, duplicate_iou_threshold: float
) -> ImageVerdicts:
    """Every GT object and kept prediction (`ImageOutcome.parsed`) of one image with its verdict, matched
    exactly as `evaluation.core.judge_image` matches for the metrics."""
    from stagectl.evaluation.core import EVAL_IOU  # (core loads torch; the report pages need only `draw`)

    preds = [_Pred(str(p["desc"]), _box(p["bbox_2d"])) for p in parsed]
    match = match_objects(preds, sample.objects, MatchCosts(iou_gate=EVAL_IOU))
    duplicates = set(find_duplicates(preds, duplicate_iou_threshold))
    iou_of_pred = {i: iou for (i, _), iou in zip(match.pairs, match.ious, strict=True)}
    matched_gt = {j for _, j in match.pairs}
    boxes = [
        DrawnBox(
            _px(obj.bbox_2d, sample), False, "matched" if j in matched_gt else "missed", f"GT {obj.desc}"
        )
        for j, obj in enumerate(sample.objects)
    ]
    num_fp = 0
    for i, (pred, row) in enumerate(zip(preds, parsed, strict=True)):
        label = f"{pred.desc} {float(row.get('score', 0.0)):.2f}"
        if i in iou_of_pred:
            verdict = "matched"
            label += f" IoU {iou_of_pred[i]:.2f}"
        else:
            verdict = "duplicate" if i in duplicates else "false_positive"
            num_fp += 1
        boxes.append(DrawnBox(_px(pred.bbox_2d, sample), True, verdict, label))
    return ImageVerdicts(boxes, len(match.fn), num_fp)


def display_scale(width: int, height: int) -> float:
    """The factor that brings the longer side of a `width` x `height` image into [MIN_SIDE, MAX_SIDE]
    (large images shrink; small ones grow so the captions stay readable)."""
    longer = max(width, height, 1)
    if longer > MAX_SIDE:
        return MAX_SIDE / longer
    if longer < MIN_SIDE:
        return MIN_SIDE / longer
    return 1.0


def draw(image_path: str, width: int, height: int, boxes: Sequence[DrawnBox]) -> Image.Image:
    """The image at `image_path`, shown at `width` x `height` (the frame its boxes are in) times
    `display_scale`, with `boxes` drawn: ground truth first, predictions on top."""
    scale = display_scale(width, height)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    with Image.open(image_path) as source:
        image = source.convert("RGB").resize(size, Image.Resampling.BILINEAR)
    canvas = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=11)
    for box in sorted(boxes, key=lambda b: b.is_pred):
        style = STYLES[(box.is_pred, box.verdict)]
        x1, y1, x2, y2 = (round(v * scale) for v in box.box_px)  # the nearest pixel (PIL would truncate)
        _rectangle(canvas, (x1, y1, x2, y2), style)
        # GT is captioned above its top edge, a matched prediction below it, an unmatched one above its
        # bottom edge (a duplicate sits on the box it repeats), so captions rarely overlap
        if not box.is_pred:
            ty = max(0, y1 - 13)
        elif box.verdict == "matched":
            ty = y1 + style.width
        else:
            ty = max(y1, y2 - 13 - style.width)
        left, top, right, bottom = canvas.textbbox((x1 + style.width, ty), box.label, font=font)
        canvas.rectangle((left - 1, top - 1, right + 1, bottom + 1), fill=style.colour)
        canvas.text((x1 + style.width, ty), box.label, fill=(255, 255, 255), font=font)
    return image


def _rectangle(canvas: ImageDraw.ImageDraw, box: tuple[int, int, int, int], style: BoxStyle) -> None:
    x1, y1, x2, y2 = box
    if style.dash is None:
        canvas.rectangle((x1, y1, x2, y2), outline=style.colour, width=style.width)
        return
    on, off = style.dash
    for a, b in (((x1, y1), (x2, y1)), ((x2, y1), (x2, y2)), ((x2, y2), (x1, y2)), ((x1, y2), (x1, y1))):
        length = max(abs(b[0] - a[0]), abs(b[1] - a[1]))
        pos = 0.0
        while pos < length:
            end = min(pos + on, length)
            p = (a[0] + (b[0] - a[0]) * pos / length, a[1] + (b[1] - a[1]) * pos / length)
            q = (a[0] + (b[0] - a[0]) * end / length, a[1] + (b[1] - a[1]) * end / length)
            canvas.line((p, q), fill=style.colour, width=style.width)
            pos += on + off


def write_gallery(
    out_dir: Path,
    samples: Sequence[DetectionSample],
    outcomes: Sequence[ImageOutcome],
    *,
    num_images: int,
    duplicate_iou_threshold: float,
) -> list[Path]:
    """The `num_images` worst images of an eval drawn into `out_dir` (PNGs, gallery.json, index.html), only
    images with a miss or a false positive; nothing when `num_images` is 0. Returns the files written. A
    gallery stopped midway is removed whole."""
    if num_images < 0:
        raise ValueError(f"--gallery must be >= 0 images, got {num_images}")
    if num_images == 0:
        return []
    judged = [
        (o, judge_for_gallery(samples[o.index], o.parsed, duplicate_iou_threshold=duplicate_iou_threshold))
        for o in outcomes
    ]
    imperfect = sorted(
        (item for item in judged if item[1].badness), key=lambda item: (-item[1].badness, item[0].index)
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        for old in out_dir.glob("*.png"):
            old.unlink()
        entries: list[dict[str, Any]] = []
        for rank, (outcome, verdicts) in enumerate(imperfect[:num_images]):
            sample = samples[outcome.index]
            name = f"{rank:03d}_{file_label(sample)}.png"
            draw(sample.images[0], sample.width, sample.height, verdicts.boxes).save(out_dir / name)
            entries.append(
                {
                    "file": name,
                    "title": image_title(sample),
                    "index": outcome.index,
                    "image_id": sample.image_id,
                    "image": sample.images[0],
                    "num_missed": verdicts.num_missed,
                    "num_fp": verdicts.num_fp,
                    "num_gt": len(sample.objects),
                    "num_pred": len(outcome.parsed),
                    "boxes": [asdict(box) for box in verdicts.boxes],
                }
            )
        listing = out_dir / GALLERY_JSON
        summary = {"num_evaluated": len(outcomes), "num_imperfect": len(imperfect)}
        listing.write_text(json.dumps({**summary, "images": entries}, indent=1) + "\n", encoding="utf-8")
        index = out_dir / INDEX_HTML
        index.write_text(render_gallery_index(entries, len(outcomes), len(imperfect)), encoding="utf-8")
        return [listing, index]
    except BaseException:  # stopped or failed midway: no half gallery (the eval writes metrics.json after it)
        shutil.rmtree(out_dir, ignore_errors=True)
        raise


def image_title(sample: DetectionSample) -> str:
    """What a drawn image is called: its file name, with the COCO `image_id` when the data has one."""
    name = Path(sample.images[0]).name
    return name if sample.image_id is None else f"{name} (image_id {sample.image_id})"


def file_label(sample: DetectionSample) -> str:
    """The image's part of a gallery file name: `id<image_id>_` when it has one, then its file stem (made safe
    for any file system; the rank before it keeps names unique)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(sample.images[0]).stem)[:80] or "image"
    return stem if sample.image_id is None else f"id{sample.image_id}_{stem}"


def gallery_intro(num_drawn: int, num_evaluated: int, num_imperfect: int) -> str:
    """The sentence over a gallery: how many images it shows of how many, or that every image is perfect."""
    if num_imperfect == 0:
        return (
            f"Every one of the {num_evaluated} evaluated images is perfect (each ground-truth object matched, no "
            "false positive): nothing to draw."
        )
    shown = "all drawn" if num_drawn == num_imperfect else f"the {num_drawn} worst drawn"
    return (
        f"{num_imperfect} of {num_evaluated} evaluated images have a miss or a false positive ({shown}, most "
        "misses + false positives first), matched exactly as the metrics match (IoU 0.5)."
    )


def render_gallery_index(entries: Sequence[dict[str, Any]], num_images: int, num_imperfect: int) -> str:
    """`gallery/index.html`: every drawn image (relative links) with its counts, and the legend."""
    from stagectl.templating import render

    intro = gallery_intro(len(entries), num_images, num_imperfect)
    rows = [box_rows(e["boxes"]) for e in entries]
    return render(
        "gallery_index.html.j2", entries=list(zip(entries, rows, strict=True)), intro=intro, legend=legend()
    )


def legend() -> list[dict[str, str]]:
    """What each colour / line style means (the HTML pages show it under a gallery)."""
    rows = []
    for (is_pred, verdict), style in STYLES.items():
        line = "solid" if style.dash is None else ("dotted" if style.dash[0] <= 2 else "dashed")
        what = ("prediction " if is_pred else "ground truth ") + verdict.replace("_", " ")
        rows.append({"what": what, "colour": "#{:02x}{:02x}{:02x}".format(*style.colour), "line": line})
    return rows


def box_rows(boxes: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """A drawn image's boxes (`gallery.json`'s `boxes`) as text for the pages: what each is, its colour and its
    caption. The PNG's captions are drawn with Pillow's built-in font, which has ASCII glyphs only; the page
    shows every label as it is (any script, HTML-escaped)."""
    rows = []
    for box in boxes[:MAX_LISTED_BOXES]:
        is_pred, verdict = bool(box.get("is_pred")), str(box.get("verdict", ""))
        style = STYLES.get((is_pred, verdict))
        rows.append(
            {
                "what": ("prediction " if is_pred else "ground truth ") + verdict.replace("_", " "),
                "colour": "" if style is None else "#{:02x}{:02x}{:02x}".format(*style.colour),
                "label": str(box.get("label", "")),
            }
        )
    if len(boxes) > MAX_LISTED_BOXES:
        more = len(boxes) - MAX_LISTED_BOXES
        rows.append({"what": f"... {more} more", "colour": "", "label": "every box: gallery.json"})
    return rows


def _box(values: Any) -> tuple[int, int, int, int]:
    x1, y1, x2, y2 = (int(v) for v in values)
    return (x1, y1, x2, y2)


def _px(bins: Sequence[int], sample: DetectionSample) -> tuple[float, float, float, float]:
    return bins_to_pixel_box(_box(bins), sample.width, sample.height)
