"""`stagectl convert coco` in process: box clipping, the JSONL it writes (read back by the loader), what is
left out and counted, every problem of a bad file in one error, nothing written on failure."""

from __future__ import annotations

import copy
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stagectl.cli.app import app
from stagectl.data.coco import CocoError, convert_coco_file, convert_instances
from stagectl.data.coco_boxes import CocoStats, clip_box
from stagectl.data.jsonl import MAX_REPORTED_ERRORS, load_jsonl_dataset
from stagectl.data.sample import DetObject, pixel_box_to_bins
from stagectl.files import atomic_write_lines


def _instances() -> dict[str, Any]:
    """Three 200x100 images (ids 7, 9, 12), categories with non-contiguous ids, five annotations."""
    return {
        "info": {"description": "test"},
        "images": [
            {"id": 7, "file_name": "a.jpg", "width": 200, "height": 100},
            {"id": 9, "file_name": "sub/b.jpg", "width": 200, "height": 100},
            {"id": 12, "file_name": "c.jpg", "width": 200, "height": 100},
        ],
        "categories": [
            {"id": 1, "name": "person"},
            {"id": 90, "name": "toothbrush"},
            {"id": 3, "name": "car"},
        ],
        "annotations": [
            {"id": 1, "image_id": 7, "category_id": 90, "bbox": [10.5, 20.25, 30.1, 40.2], "iscrowd": 0},
            {"id": 2, "image_id": 7, "category_id": 1, "bbox": [0, 0, 200, 100], "iscrowd": 0},
            {"id": 3, "image_id": 9, "category_id": 1, "bbox": [5, 5, 50, 50], "iscrowd": 1},
            {"id": 4, "image_id": 9, "category_id": 3, "bbox": [190, 90, 20, 20]},  # no iscrowd (LVIS): 0
            {"id": 5, "image_id": 7, "category_id": 1, "bbox": [50, 50, 0, 10], "iscrowd": 0},
        ],
    }


def _convert(instances: Any, **kwargs: Any) -> tuple[list[dict[str, Any]], CocoStats]:
    kwargs.setdefault("image_exists", lambda path: True)
    return convert_instances(
        instances, Path("/data/coco/val"), Path("/data/out"), source="inst.json", **kwargs
    )


def _write_images(root: Path, instances: dict[str, Any]) -> Path:
    for image in instances["images"]:
        (root / "images" / image["file_name"]).parent.mkdir(parents=True, exist_ok=True)
        (root / "images" / image["file_name"]).write_bytes(b"not decoded")  # only stat-ed
    path = root / "instances.json"
    path.write_text(json.dumps(instances))
    return path


@pytest.mark.parametrize(
    ("xywh", "expected"),
    [
        ((10.0, 20.0, 30.0, 40.0), ((10, 20, 40, 60), "kept")),
        ((0.0, 0.0, 200.0, 100.0), ((0, 0, 200, 100), "kept")),  # COCO's right edge x + w == W is inside
        ((0.1, 0.2, 0.2, 0.1), ((0.1, 0.2, 0.3, 0.3), "kept")),  # 0.1 + 0.2 = 0.30000000000000004, tidied
        ((10.25, 20.5, 30.125, 40.0), ((10.25, 20.5, 40.375, 60.5), "kept")),
        ((-5.0, 10.0, 20.0, 20.0), ((0, 10, 15, 30), "clamped")),
        ((190.0, 90.0, 20.0, 20.0), ((190, 90, 200, 100), "clamped")),
        ((10.0, -1e-9, 5.0, 5.0), ((10, 0, 15, 5), "clamped")),
        ((10.0, 10.0, 0.0, 5.0), (None, "zero_area")),
        ((10.0, 10.0, 5.0, -1.0), (None, "zero_area")),
        ((200.0, 10.0, 5.0, 5.0), (None, "outside")),  # starts on the right edge
        ((-10.0, 10.0, 5.0, 5.0), (None, "outside")),
        ((10.0, 150.0, 5.0, 5.0), (None, "outside")),
    ],
)
def test_clip_box(xywh: tuple[float, float, float, float], expected: tuple[Any, str]) -> None:
    assert clip_box(xywh, 200, 100) == expected


@pytest.mark.parametrize(
    ("xywh", "expected"),
    [
        ((99.0, 50.0, 0.9, 40.0), (None, "zero_on_grid")),  # one bin is 1919 / 999 = 1.92 px wide here
        ((300.0, 99.0, 40.0, 0.5), (None, "zero_on_grid")),
        ((1919.5, 50.0, 5.0, 40.0), (None, "zero_on_grid")),  # clamped to 0.5 px at the right edge
        ((99.0, 50.0, 1.9, 40.0), ((99, 50, 100.9, 90), "kept")),  # 51.54 -> 52, 52.53 -> 53: one bin
    ],
)
def test_a_box_with_no_width_or_height_on_the_norm_1000_grid_is_left_out(
    xywh: tuple[float, float, float, float], expected: tuple[Any, str]
) -> None:
    """The loader stores pixel boxes as norm-1000 bins: a 0.9 px wide box on a 1920 px image had both x
    edges in bin 52 there, a zero-width target; it is left out as a `w: 0` box is."""
    assert clip_box(xywh, 1920, 1080) == expected
    if expected[0] is not None:
        x1, y1, x2, y2 = pixel_box_to_bins(expected[0], 1920, 1080)
        assert x2 > x1 and y2 > y1


def test_a_box_zero_area_on_the_grid_is_counted_in_the_summary_and_never_loaded(tmp_path: Path) -> None:
    instances = _instances()
    instances["images"][0].update(width=1920, height=1080)
    instances["annotations"] = [
        {"id": 1, "image_id": 7, "category_id": 1, "bbox": [99.0, 50.0, 0.9, 40.0]},
        {"id": 2, "image_id": 7, "category_id": 1, "bbox": [99.0, 50.0, 0.9, 40.0], "iscrowd": 1},
        {"id": 3, "image_id": 7, "category_id": 3, "bbox": [300, 300, 100, 100]},
    ]
    path = _write_images(tmp_path, instances)
    out = tmp_path / "out.jsonl"
    stats = convert_coco_file(path, tmp_path / "images", out)
    assert (stats.num_zero_on_grid, stats.num_objects, stats.num_crowd, stats.num_zero_area) == (2, 1, 0, 0)
    assert "skipped: 0 zero-area, 2 zero-area on the norm-1000 grid, 0 outside the image" in stats.summary(
        out
    )
    samples = load_jsonl_dataset(out, box_format="pixel")
    boxes = [obj.bbox_2d for sample in samples for obj in (*sample.objects, *sample.crowd)]
    assert boxes == [pixel_box_to_bins((300, 300, 400, 400), 1920, 1080)]


@pytest.mark.parametrize("checked", [True, False])
def test_one_image_file_under_two_image_ids_is_refused_naming_both(checked: bool) -> None:
    """It was written as two JSONL lines of one image (pycocotools scores two ids as two images: a broken
    export); refused with the other problems of the file, as a duplicate id is."""
    instances = _instances()
    instances["images"].append({"id": 30, "file_name": "./sub/b.jpg", "width": 200, "height": 100})
    instances["annotations"].append({"id": 40, "image_id": 30, "category_id": 1, "bbox": [1, 1, 2, 2]})
    exists = (lambda path: True) if checked else None
    with pytest.raises(CocoError) as caught:
        _convert(instances, image_exists=exists)
    assert caught.value.errors == [
        "inst.json: images[3] (id 30): file_name './sub/b.jpg' is also image id 9's; one image file must be "
        "one image (COCO tools would score its two ids as two images)"
    ]


def test_lines_keep_coco_ids_names_pixel_boxes_and_crowd_regions_apart() -> None:
    """The crowd box (annotation 3) is no object to train on, but the eval needs it (COCOeval ignores
    predictions on a crowd region): it goes to the line's `crowd` list."""
    lines, stats = _convert(_instances())
    assert lines == [
        {
            "images": ["../coco/val/a.jpg"],  # relative to the output file's directory
            "width": 200,
            "height": 100,
            "objects": [
                {"desc": "toothbrush", "bbox_2d": [10.5, 20.25, 40.6, 60.45], "category_id": 90},
                {"desc": "person", "bbox_2d": [0, 0, 200, 100], "category_id": 1},
            ],
            "image_id": 7,
        },
        {
            "images": ["../coco/val/sub/b.jpg"],
            "width": 200,
            "height": 100,
            "objects": [{"desc": "car", "bbox_2d": [190, 90, 200, 100], "category_id": 3}],
            "image_id": 9,
            "crowd": [{"desc": "person", "bbox_2d": [5, 5, 55, 55], "category_id": 1}],
        },
        {"images": ["../coco/val/c.jpg"], "width": 200, "height": 100, "objects": [], "image_id": 12},
    ]
    assert (stats.num_images, stats.num_empty, stats.num_objects, stats.num_categories) == (3, 1, 3, 3)
    assert (stats.num_crowd, stats.num_zero_area, stats.num_outside, stats.num_clamped) == (1, 1, 0, 1)
    assert stats.class_counts == {"person": 1, "toothbrush": 1, "car": 1}


def test_coco_area_is_kept_for_the_evals_size_buckets() -> None:
    """COCO's `area` (the mask's) decides small / medium / large in COCOeval; a missing one stays missing."""
    instances = _instances()
    instances["annotations"][0]["area"] = 702.25
    instances["annotations"][2]["area"] = 2500  # the crowd region
    lines, _ = _convert(instances)
    assert [obj.get("area") for obj in lines[0]["objects"]] == [702.25, None]
    assert lines[1]["crowd"][0]["area"] == 2500
    instances["annotations"][1]["area"] = -3
    with pytest.raises(CocoError, match=r"annotations\[1\] \(id 2\): area must be a non-negative number"):
        _convert(instances)


def test_drop_empty_leaves_out_images_with_no_object_left() -> None:
    instances = _instances()
    instances["annotations"][3]["iscrowd"] = 1  # image 9 now has only crowd boxes
    lines, stats = _convert(instances, drop_empty=True)
    assert [line["image_id"] for line in lines] == [7]
    # image 9's crowd regions leave with it: the count is of the crowd regions written
    assert (stats.num_images, stats.num_empty, stats.num_dropped_empty, stats.num_crowd) == (1, 0, 2, 0)
    assert "2 images without objects (--drop-empty)" in stats.summary(Path("out.jsonl"))


def test_clamped_counts_the_objects_written_not_crowd_regions() -> None:
    """A clamped crowd region, the only annotation of an image --drop-empty left out, was counted as
    `clamped to the image: 1` although nothing clamped was written."""
    instances = {
        "images": [
            {"id": 1, "file_name": "a.jpg", "width": 100, "height": 100},
            {"id": 2, "file_name": "b.jpg", "width": 100, "height": 100},
        ],
        "categories": [{"id": 1, "name": "person"}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [90, 90, 20, 20], "iscrowd": 1, "area": 50},
            {"id": 2, "image_id": 2, "category_id": 1, "bbox": [95, 10, 20, 20], "iscrowd": 0, "area": 300},
        ],
    }
    lines, stats = _convert(instances, drop_empty=True)
    assert [line["image_id"] for line in lines] == [2]
    assert (stats.num_clamped, stats.num_crowd, stats.num_dropped_empty) == (1, 0, 1)


def test_drop_empty_refuses_to_write_an_empty_file() -> None:
    instances = _instances()
    instances["annotations"] = []
    with pytest.raises(CocoError, match="--drop-empty leaves out all of them"):
        _convert(instances, drop_empty=True)


def test_lvis_image_without_file_name_uses_the_coco_url() -> None:
    instances = _instances()
    del instances["images"][0]["file_name"]
    instances["images"][0]["coco_url"] = "http://images.cocodataset.org/val2017/000000000007.jpg"
    lines, _ = _convert(instances)
    assert lines[0]["images"] == ["../coco/val/val2017/000000000007.jpg"]


def test_summary_names_top_classes_and_what_was_skipped() -> None:
    instances = _instances()
    names = [f"class{i}" for i in range(12)]
    instances["categories"] = [{"id": 100 + i, "name": name} for i, name in enumerate(names)]
    instances["annotations"] = [
        {"image_id": 7, "category_id": 100 + i, "bbox": [1, 1, 2, 2]} for i in range(12) for _ in range(i + 1)
    ]
    _, stats = _convert(instances)
    summary = stats.summary(Path("out.jsonl"))
    assert "\n" not in summary
    assert summary.startswith("wrote 3 images (2 without objects), 78 objects of 12 categories to out.jsonl")
    top = ", ".join(f"class{i} {i + 1}" for i in range(11, 1, -1))  # ten, most frequent first
    assert f"top classes: {top};" in summary
    assert (
        "crowd regions (iscrowd: 1, eval only, not trained on): 0; skipped: 0 zero-area, 0 zero-area on the "
        "norm-1000 grid, 0 outside the image; clamped to the image: 0" in summary
    )
    assert summary.endswith("train with data.box_format: pixel")


def test_every_problem_of_the_file_in_one_error() -> None:
    instances = _instances()
    instances["categories"].append({"id": 3, "name": "truck"})  # duplicate id
    instances["categories"].append({"id": 4, "name": "person"})  # duplicate name
    instances["categories"].append({"id": 5, "name": "<|im_end|>"})  # would encode as end of turn
    instances["images"].append({"id": 9, "file_name": "d.jpg", "width": 200, "height": 100})  # duplicate id
    instances["images"].append({"id": 13, "file_name": "missing.jpg", "width": 200, "height": 100})
    instances["images"].append({"id": 14, "file_name": "e.jpg", "width": 0, "height": 100})
    instances["annotations"] += [
        {"id": 20, "image_id": 99, "category_id": 1, "bbox": [1, 1, 2, 2]},
        {"id": 21, "image_id": 7, "category_id": 2, "bbox": [1, 1, 2, 2]},
        {"id": 22, "image_id": 7, "category_id": 1, "bbox": [1, 1, 2]},
        {"id": 23, "image_id": 7, "category_id": 1, "bbox": [1, 1, 2, float("nan")]},
        {"id": 24, "image_id": 7, "category_id": 1, "bbox": [1, 1, 2, 2], "iscrowd": 2},
        {"id": 25, "image_id": "7", "category_id": 1, "bbox": [1, 1, 2, 2]},
    ]
    with pytest.raises(CocoError) as caught:
        _convert(instances, image_exists=lambda path: not path.endswith("missing.jpg"))
    assert caught.value.errors == [
        "inst.json: categories[3] (id 3): duplicate category id 3 (also 'car')",
        "inst.json: categories[4] (id 4): name 'person' is also category id 1's; a desc must name one category",
        "inst.json: categories[5] (id 5): name '<|im_end|>' spells a special token (<|...|>), which cannot be a desc",
        "inst.json: images[3] (id 9): duplicate image id 9",
        "inst.json: images[4] (id 13): image file not found: /data/coco/val/missing.jpg",
        "inst.json: images[5] (id 14): width must be a positive integer, got 0",
        "inst.json: annotations[5] (id 20): image_id 99 is not in images",
        "inst.json: annotations[6] (id 21): category_id 2 is not in categories",
        "inst.json: annotations[7] (id 22): bbox must be 4 finite numbers [x, y, w, h], got [1, 1, 2]",
        "inst.json: annotations[8] (id 23): bbox must be 4 finite numbers [x, y, w, h], got [1, 1, 2, nan]",
        "inst.json: annotations[9] (id 24): iscrowd must be 0 or 1, got 2",
        "inst.json: annotations[10] (id 25): image_id must be a non-negative integer, got '7'",
    ]


def test_many_problems_are_capped_and_counted() -> None:
    instances = _instances()
    instances["annotations"] = [
        {"image_id": 1000 + i, "category_id": 1, "bbox": [1, 1, 2, 2]} for i in range(50)
    ]
    with pytest.raises(CocoError) as caught:
        _convert(instances)
    assert len(caught.value.errors) == MAX_REPORTED_ERRORS and caught.value.num_errors == 50
    assert str(caught.value).endswith(f"... and {50 - MAX_REPORTED_ERRORS} more problems")


def test_no_image_found_says_the_images_dir_is_wrong() -> None:
    with pytest.raises(CocoError) as caught:
        _convert(_instances(), image_exists=lambda path: False)
    assert caught.value.errors[0] == "inst.json: none of the 3 image files is under --images /data/coco/val"
    assert caught.value.num_errors == 4  # the hint and one per image; their annotations are not repeated


@pytest.mark.parametrize(
    ("instances", "message"),
    [
        ([], "a COCO instances file is a JSON object, got list"),
        (
            {"images": [], "categories": []},
            "'annotations' must be lists (an image_info file has no annotations",
        ),
        ({"images": {}, "annotations": [], "categories": None}, "'images', 'categories' must be lists"),
        ({"images": [], "annotations": [], "categories": []}, "'images' is empty: nothing to convert"),
    ],
)
def test_not_an_instances_file(instances: Any, message: str) -> None:
    with pytest.raises(CocoError, match=r"^inst\.json: ") as caught:
        _convert(instances)
    assert message in str(caught.value)


def test_progress_follows_the_annotations() -> None:
    instances = _instances()
    instances["annotations"] = [copy.deepcopy(instances["annotations"][0]) for _ in range(2500)]
    seen: list[tuple[int, int]] = []
    _convert(instances, on_progress=lambda done, total: seen.append((done, total)))
    assert seen == [(0, 2500), (1000, 2500), (2000, 2500), (2500, 2500)]


def test_file_round_trips_through_the_loader(tmp_path: Path) -> None:
    instances = _instances()
    path = _write_images(tmp_path, instances)
    out = tmp_path / "jsonl" / "val.jsonl"
    stats = convert_coco_file(path, tmp_path / "images", out)
    assert stats.num_images == 3
    samples = load_jsonl_dataset(out, box_format="pixel")
    assert [s.images for s in samples] == [
        [str(tmp_path / "images" / name)] for name in ("a.jpg", "sub/b.jpg", "c.jpg")
    ]
    assert [s.image_id for s in samples] == [7, 9, 12]
    assert samples[0].objects == [
        DetObject("toothbrush", pixel_box_to_bins((10.5, 20.25, 40.6, 60.45), 200, 100), category_id=90),
        DetObject("person", (0, 0, 999, 999), category_id=1),
    ]
    assert samples[1].objects == [
        DetObject("car", pixel_box_to_bins((190, 90, 200, 100), 200, 100), category_id=3)
    ]
    assert samples[2].objects == []


def test_bad_file_writes_nothing_and_keeps_the_old_output(tmp_path: Path) -> None:
    instances = _instances()
    instances["annotations"][0]["category_id"] = 5
    path = _write_images(tmp_path, instances)
    out = tmp_path / "val.jsonl"
    out.write_text("old\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CocoError, match="category_id 5 is not in categories"):
        convert_coco_file(path, tmp_path / "images", out)
    assert out.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ('{"images": [', "not valid JSON: Expecting value (line 1, column 13)"),
        (b"\xff\xfe\x00", "not valid JSON"),
    ],
)
def test_unreadable_instances_file_is_one_line(
    tmp_path: Path, content: str | bytes | None, message: str
) -> None:
    path = tmp_path / "instances.json"
    if isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    (tmp_path / "images").mkdir()
    with pytest.raises(CocoError) as caught:
        convert_coco_file(path, tmp_path / "images", tmp_path / "out.jsonl")
    assert len(caught.value.errors) == 1 and caught.value.errors[0].startswith(f"{path}: {message}")
    assert not (tmp_path / "out.jsonl").exists()


def test_missing_images_dir_is_refused_unless_not_checked(tmp_path: Path) -> None:
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(_instances()))
    with pytest.raises(CocoError, match=r"--images .*nowhere: no such directory"):
        convert_coco_file(path, tmp_path / "nowhere", tmp_path / "out.jsonl")
    stats = convert_coco_file(path, tmp_path / "nowhere", tmp_path / "out.jsonl", check_images=False)
    assert stats.num_images == 3 and len((tmp_path / "out.jsonl").read_text().splitlines()) == 3


def test_cli_prints_the_summary_or_every_problem(tmp_path: Path) -> None:
    instances = _instances()
    path = _write_images(tmp_path, instances)
    out = tmp_path / "out.jsonl"
    runner = CliRunner()
    ok = runner.invoke(
        app, ["convert", "coco", str(path), "--images", str(tmp_path / "images"), "--out", str(out)]
    )
    assert ok.exit_code == 0, ok.output
    assert f"wrote 3 images (1 without objects), 3 objects of 3 categories to {out}" in ok.stdout
    assert len(out.read_text().splitlines()) == 3

    instances["annotations"][0]["image_id"] = 8
    instances["annotations"][1]["bbox"] = None
    path.write_text(json.dumps(instances))
    out.unlink()
    bad = runner.invoke(
        app, ["convert", "coco", str(path), "--images", str(tmp_path / "images"), "--out", str(out)]
    )
    assert bad.exit_code == 1
    assert f"error: {path}: annotations[0] (id 1): image_id 8 is not in images\n" in bad.stderr
    assert f"{path}: annotations[1] (id 2): bbox must be 4 finite numbers" in bad.stderr
    assert "Traceback" not in bad.output and not out.exists()


def test_the_coco_example_reads_what_convert_writes() -> None:
    from stagectl.config import load_config

    cfg = load_config(Path(__file__).parents[3] / "examples" / "coco" / "train_ab.yaml")
    assert cfg.data is not None and cfg.data.box_format == "pixel"
    assert cfg.data.train_jsonl is not None and cfg.data.eval is not None and cfg.data.eval.jsonl is not None


def test_writer_is_whole_or_nothing_with_a_plain_file_mode(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    with pytest.raises(TypeError):  # fails on the second line, after the first was written
        atomic_write_lines(out, (json.dumps(line) + "\n" for line in [{"a": 1}, {"b": object()}]))
    assert out.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]
    umask = os.umask(0o027)
    try:
        atomic_write_lines(out, ['{"a": 1}\n', '{"b": "é"}\n'])
    finally:
        os.umask(umask)
    assert out.read_text(encoding="utf-8") == '{"a": 1}\n{"b": "é"}\n'
    assert stat.S_IMODE(out.stat().st_mode) == 0o640  # not mkstemp's 0600


def test_cli_out_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    path = _write_images(tmp_path, _instances())
    out = tmp_path / "taken.jsonl"
    out.mkdir()
    result = CliRunner().invoke(
        app, ["convert", "coco", str(path), "--images", str(tmp_path / "images"), "--out", str(out)]
    )
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"error: --out {out}: cannot write: it is a directory; give the path of the JSONL file to write"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "instances.json", "taken.jsonl"]
