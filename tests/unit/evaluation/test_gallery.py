"""The eval gallery: boxes drawn where they are (pixel checks on a synthetic image), colours and line styles
following the metrics' matching, worst images first, an index that links only files that exist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from stagectl.data.sample import DetectionSample, DetObject, pixel_box_to_bins
from stagectl.detection.stats import RolloutStats
from stagectl.evaluation.core import ImageOutcome
from stagectl.evaluation.gallery import STYLES, draw, judge_for_gallery, write_gallery
from stagectl.report.html import eval_gallery, page_links

WHITE = (255, 255, 255)
GT_BOX = (80.0, 40.0, 240.0, 160.0)  # pixels on a 400 x 200 image (drawn at its own size)


def white_image(tmp_path: Path, width: int, height: int, name: str = "img.png") -> str:
    path = tmp_path / name
    Image.new("RGB", (width, height), WHITE).save(path)
    return str(path)


def sample_with(path: str, width: int, height: int, box: tuple[float, ...]) -> DetectionSample:
    return DetectionSample(
        [path], width, height, [DetObject("red circle", pixel_box_to_bins(box, width, height))]
    )


def pred(
    sample: DetectionSample, box: tuple[float, ...], desc: str = "red circle", score: float = 0.9
) -> dict:
    return {
        "desc": desc,
        "bbox_2d": list(pixel_box_to_bins(box, sample.width, sample.height)),
        "score": score,
    }


def colour(style_key: tuple[bool, str]) -> tuple[int, int, int]:
    return STYLES[style_key].colour


def edge_colours(image: Image.Image, box: tuple[float, ...], scale: float = 1.0) -> set[tuple[int, int, int]]:
    """Colours on the bottom edge of `box` (away from the captions at the top)."""
    x1, _, x2, y2 = (round(v * scale) for v in box)
    return {image.getpixel((x, y2)) for x in range(x1 + 4, x2 - 4)}  # type: ignore[misc]


def test_a_matched_prediction_is_drawn_on_its_box_and_nowhere_else(tmp_path: Path) -> None:
    sample = sample_with(white_image(tmp_path, 400, 200), 400, 200, GT_BOX)
    verdicts = judge_for_gallery(sample, [pred(sample, GT_BOX)], duplicate_iou_threshold=0.7)
    assert [(b.is_pred, b.verdict) for b in verdicts.boxes] == [(False, "matched"), (True, "matched")]
    assert verdicts.badness == 0
    image = draw(sample.images[0], 400, 200, verdicts.boxes)
    assert image.size == (400, 200)
    blue = colour((True, "matched"))
    assert edge_colours(image, GT_BOX) == {blue}  # the prediction, solid, on top of the GT
    assert image.getpixel((120, 160)) == blue and image.getpixel((80, 100)) == blue  # bottom and left edges
    assert image.getpixel((160, 100)) == WHITE  # inside the box
    assert image.getpixel((300, 100)) == WHITE and image.getpixel((120, 180)) == WHITE  # outside it


def test_a_small_image_is_enlarged_with_its_boxes(tmp_path: Path) -> None:
    sample = sample_with(white_image(tmp_path, 112, 112), 112, 112, (28.0, 28.0, 84.0, 84.0))
    image = draw(sample.images[0], 112, 112, judge_for_gallery(sample, [], duplicate_iou_threshold=0.7).boxes)
    assert image.size == (320, 320)
    scale = 320 / 112
    assert colour((False, "missed")) in edge_colours(image, (28.0, 28.0, 84.0, 84.0), scale)
    assert image.getpixel((160, 160)) == WHITE


def test_a_large_image_is_scaled_with_its_boxes(tmp_path: Path) -> None:
    big_box = (400.0, 200.0, 1200.0, 800.0)
    sample = sample_with(white_image(tmp_path, 2000, 1000), 2000, 1000, big_box)
    verdicts = judge_for_gallery(sample, [], duplicate_iou_threshold=0.7)
    image = draw(sample.images[0], 2000, 1000, verdicts.boxes)
    assert image.size == (640, 320)
    scale = 640 / 2000
    orange = colour((False, "missed"))
    assert orange in edge_colours(image, big_box, scale)
    assert image.getpixel((round(800 * scale), round(600 * scale))) == WHITE
    assert orange not in edge_colours(image, (400.0, 200.0, 1200.0, 700.0), scale)  # not 100 px lower


def test_colours_and_line_styles_follow_the_match(tmp_path: Path) -> None:
    sample = sample_with(white_image(tmp_path, 400, 200), 400, 200, GT_BOX)
    far = (280.0, 20.0, 380.0, 120.0)
    verdicts = judge_for_gallery(sample, [pred(sample, far, "blue square")], duplicate_iou_threshold=0.7)
    assert [(b.is_pred, b.verdict) for b in verdicts.boxes] == [(False, "missed"), (True, "false_positive")]
    assert (verdicts.num_missed, verdicts.num_fp) == (1, 1)
    assert verdicts.boxes[1].label == "blue square 0.90"
    image = draw(sample.images[0], 400, 200, verdicts.boxes)
    red, orange = colour((True, "false_positive")), colour((False, "missed"))
    assert edge_colours(image, far) == {red, WHITE}  # dashed: gaps show the image
    assert edge_colours(image, GT_BOX) == {orange, WHITE}
    assert len({s.colour for s in STYLES.values()}) == len(STYLES)  # every mark its own colour


def test_the_eval_iou_gate_and_duplicates_decide_the_verdict(tmp_path: Path) -> None:
    sample = sample_with(white_image(tmp_path, 400, 200), 400, 200, GT_BOX)
    # IoU 0.45 (below the eval's 0.5 gate): a false positive; IoU 0.6: a match
    low = pred(sample, (80.0, 40.0, 240.0, 94.0))
    assert [b.verdict for b in judge_for_gallery(sample, [low], duplicate_iou_threshold=0.7).boxes] == [
        "missed",
        "false_positive",
    ]
    high = pred(sample, (80.0, 40.0, 240.0, 112.0))
    assert [b.verdict for b in judge_for_gallery(sample, [high], duplicate_iou_threshold=0.7).boxes] == [
        "matched",
        "matched",
    ]
    # the exact box takes the GT; the repeat of it (IoU 0.6 >= 0.5, same desc) is marked a duplicate
    boxes = judge_for_gallery(sample, [pred(sample, GT_BOX), high], duplicate_iou_threshold=0.5).boxes
    assert [b.verdict for b in boxes] == ["matched", "matched", "duplicate"]
    assert boxes[1].label == "red circle 0.90 IoU 1.00"


def outcome(index: int, parsed: list[dict]) -> ImageOutcome:
    return ImageOutcome(index, RolloutStats(), [], 0, parsed)


def test_write_gallery_puts_the_worst_first_and_links_only_written_files(tmp_path: Path) -> None:
    path = white_image(tmp_path, 400, 200)
    samples = [sample_with(path, 400, 200, GT_BOX) for _ in range(3)]
    outcomes = [
        outcome(0, [pred(samples[0], GT_BOX)]),  # perfect
        outcome(1, [pred(samples[1], (280.0, 20.0, 380.0, 120.0))]),  # 1 miss + 1 FP
        outcome(2, []),  # 1 miss
    ]
    out = tmp_path / "gallery"
    written = write_gallery(out, samples, outcomes, num_images=2, duplicate_iou_threshold=0.7)
    listing = json.loads((out / "gallery.json").read_text())
    assert [e["index"] for e in listing["images"]] == [1, 2]
    assert (listing["num_evaluated"], listing["num_imperfect"]) == (3, 2)
    assert sorted(p.name for p in out.glob("*.png")) == ["000_img.png", "001_img.png"]
    index = (out / "index.html").read_text()
    links = page_links(index)
    assert links == ["000_img.png", "001_img.png"]
    assert "2 of 3 evaluated images have a miss or a false positive (all drawn" in index
    assert all((out / link).is_file() for link in links)
    assert {p.name for p in written} == {"gallery.json", "index.html"}
    assert (
        write_gallery(tmp_path / "none", samples, outcomes, num_images=0, duplicate_iou_threshold=0.7) == []
    )
    assert not (tmp_path / "none").exists()
    with pytest.raises(ValueError, match="--gallery"):
        write_gallery(out, samples, outcomes, num_images=-1, duplicate_iou_threshold=0.7)


def test_images_are_named_by_their_coco_id_and_file_name(tmp_path: Path) -> None:
    """Not by their line (`image 0`, `000_image00001.png`): a COCO image by its image_id and file, any other
    by its file; the position in the evaluated set stays in gallery.json."""
    coco = white_image(tmp_path, 400, 200, "000000000139.jpg")
    other = white_image(tmp_path, 400, 200, "street view #2.png")
    samples = [
        DetectionSample([coco], 400, 200, sample_with(coco, 400, 200, GT_BOX).objects, image_id=139),
        sample_with(other, 400, 200, GT_BOX),
    ]
    out = tmp_path / "gallery"
    write_gallery(out, samples, [outcome(0, []), outcome(1, [])], num_images=5, duplicate_iou_threshold=0.7)
    listing = json.loads((out / "gallery.json").read_text())
    assert [(e["file"], e["title"], e["index"]) for e in listing["images"]] == [
        ("000_id139_000000000139.png", "000000000139.jpg (image_id 139)", 0),
        ("001_street_view_2.png", "street view #2.png", 1),
    ]
    index = (out / "index.html").read_text()
    assert "000000000139.jpg (image_id 139): 1 missed" in index and "image 0" not in index
    page = eval_gallery(tmp_path, tmp_path, "Prediction gallery")  # the report page reads the same names
    assert page is not None and [f.title for f in page.items] == [e["title"] for e in listing["images"]]


def test_a_perfect_eval_draws_nothing_and_says_so(tmp_path: Path) -> None:
    path = white_image(tmp_path, 400, 200)
    samples = [sample_with(path, 400, 200, GT_BOX) for _ in range(3)]
    outcomes = [outcome(k, [pred(samples[k], GT_BOX)]) for k in range(3)]
    out = tmp_path / "gallery"
    write_gallery(out, samples, outcomes, num_images=24, duplicate_iou_threshold=0.7)
    assert list(out.glob("*.png")) == []
    assert json.loads((out / "gallery.json").read_text())["images"] == []
    assert "Every one of the 3 evaluated images is perfect" in (out / "index.html").read_text()
    page = eval_gallery(tmp_path, tmp_path, "Prediction gallery")
    assert page is not None and page.items == [] and "is perfect" in page.intro
