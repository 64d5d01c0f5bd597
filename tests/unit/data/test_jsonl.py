"""load_jsonl_dataset: good lines load (pixel and norm-1000 boxes); every bad line is `file:line: ...`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from stagectl.data.jsonl import MAX_REPORTED_ERRORS, DataError, load_jsonl_dataset
from stagectl.data.sample import DetectionSample, DetObject


def _record(**overrides: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "images": ["img/a.png"],
        "width": 112,
        "height": 56,
        "objects": [{"desc": "red circle", "bbox_2d": [10, 5, 40, 30]}],
    }
    record.update(overrides)
    return record


def _write(tmp_path: Path, lines: list[Any]) -> Path:
    """Write one JSONL line per item (dicts are dumped, strings written raw) plus the images they use."""
    (tmp_path / "img").mkdir(exist_ok=True)
    for name in ("a.png", "b.png"):
        (tmp_path / "img" / name).write_bytes(b"not decoded")  # the loader only stats images
    path = tmp_path / "data.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_pixel_boxes_load_as_bins_with_absolute_paths(tmp_path: Path) -> None:
    path = _write(tmp_path, [_record(), "", _record(images=["img/b.png"], objects=[])])
    samples = load_jsonl_dataset(path, box_format="pixel")
    assert samples == [
        DetectionSample(
            images=[str(tmp_path / "img" / "a.png")],
            width=112,
            height=56,
            objects=[DetObject("red circle", (90, 91, 360, 545))],  # 999*x/111, 999*y/55 rounded
        ),
        DetectionSample(images=[str(tmp_path / "img" / "b.png")], width=112, height=56, objects=[]),
    ]


def test_norm1000_boxes_load_unchanged(tmp_path: Path) -> None:
    path = _write(tmp_path, [_record(objects=[{"desc": "blue square", "bbox_2d": [0, 100, 999, 999]}])])
    (sample,) = load_jsonl_dataset(path)  # norm1000 is the default
    assert sample.objects == [DetObject("blue square", (0, 100, 999, 999))]


def test_coco_ids_ride_along_and_round_trip(tmp_path: Path) -> None:
    objects = [{"desc": "dog", "bbox_2d": [0, 100, 999, 999], "category_id": 18}]
    path = _write(tmp_path, [_record(image_id=397133, objects=objects), _record()])
    with_ids, without = load_jsonl_dataset(path)
    assert with_ids.image_id == 397133 and with_ids.objects[0].category_id == 18
    assert without.image_id is None and without.objects[0].category_id is None
    line = with_ids.to_json_dict()
    assert line["image_id"] == 397133 and line["objects"][0]["category_id"] == 18
    assert "image_id" not in without.to_json_dict()


def test_a_coco_instances_file_given_as_the_data_says_to_convert_it(tmp_path: Path) -> None:
    """`--data instances_val2017.json` (or data.train_jsonl) was `line 1: missing field 'width'`."""
    instances = {
        "info": {"description": "COCO 2017"},
        "images": [{"id": 1, "file_name": "a.png", "width": 112, "height": 56}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 2, 3, 4]}],
        "categories": [{"id": 1, "name": "person"}],
    }
    path = _write(tmp_path, [instances])
    with pytest.raises(DataError, match=re.escape(f"{path}:1: this is a COCO instances file")) as caught:
        load_jsonl_dataset(path)
    assert "stagectl convert coco" in str(caught.value)


def test_coco_area_rides_along_and_round_trips(tmp_path: Path) -> None:
    objects = [{"desc": "dog", "bbox_2d": [0, 100, 999, 999], "category_id": 18, "area": 1234.5}]
    path = _write(tmp_path, [_record(objects=objects)])
    (sample,) = load_jsonl_dataset(path)
    assert sample.objects == [DetObject("dog", (0, 100, 999, 999), category_id=18, area=1234.5)]
    assert sample.to_json_dict()["objects"] == objects
    bad = _write(tmp_path, [_record(objects=[{**objects[0], "area": "big"}])])
    with pytest.raises(
        DataError, match=re.escape(f"{bad}:1: objects[0]: area must be a non-negative number")
    ):
        load_jsonl_dataset(bad)


def test_crowd_regions_load_apart_from_the_objects_and_round_trip(tmp_path: Path) -> None:
    """`stagectl convert coco` writes COCO's iscrowd regions to `crowd` (pixel boxes like the objects)."""
    crowd = [{"desc": "person", "bbox_2d": [0, 0, 111.5, 55], "category_id": 1}]
    path = _write(tmp_path, [_record(image_id=7, crowd=crowd)])
    (sample,) = load_jsonl_dataset(path, box_format="auto")  # 111.5 decides pixel: crowd boxes count
    assert sample.crowd == [DetObject("person", (0, 0, 999, 999), category_id=1)]
    assert [obj.desc for obj in sample.objects] == ["red circle"]  # the objects trained on: no crowd
    assert load_jsonl_dataset(_write(tmp_path, [sample.to_json_dict()])) == [sample]


@pytest.mark.parametrize(
    ("crowd", "expected"),
    [
        ({"desc": "person", "bbox_2d": [0, 0, 200, 10]}, "crowd[0]: bbox_2d [0, 0, 200, 10] is outside the"),
        ({"desc": "person"}, "crowd[0]: missing field 'bbox_2d'"),
        ("person", "crowd[0]: must be an object with desc and bbox_2d"),
    ],
)
def test_bad_crowd_regions_are_line_errors_naming_them(tmp_path: Path, crowd: Any, expected: str) -> None:
    path = _write(tmp_path, [_record(crowd=[crowd])])
    with pytest.raises(DataError, match=re.escape(f"{path}:1: {expected}")):
        load_jsonl_dataset(path, box_format="pixel")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"image_id": -1}, "image_id must be a non-negative integer, got -1"),
        ({"image_id": "7"}, "image_id must be a non-negative integer, got '7'"),
        (
            {"objects": [{"desc": "x", "bbox_2d": [0, 0, 9, 9], "category_id": 1.5}]},
            "objects[0]: category_id must be a non-negative integer, got 1.5",
        ),
    ],
)
def test_bad_coco_ids_are_line_errors(tmp_path: Path, overrides: dict[str, Any], expected: str) -> None:
    path = _write(tmp_path, [_record(**overrides)])
    with pytest.raises(DataError, match=re.escape(f"{path}:1: {expected}")):
        load_jsonl_dataset(path)


def test_pixel_box_may_touch_the_exclusive_edge(tmp_path: Path) -> None:
    path = _write(tmp_path, [_record(objects=[{"desc": "x", "bbox_2d": [0, 0, 112, 56]}])])
    (sample,) = load_jsonl_dataset(path, box_format="pixel")
    assert sample.objects[0].bbox_2d == (0, 0, 999, 999)


def test_image_root_and_absolute_paths(tmp_path: Path) -> None:
    root = tmp_path / "elsewhere"
    root.mkdir()
    (root / "c.png").write_bytes(b"x")
    absolute = tmp_path / "img" / "a.png"
    path = _write(tmp_path, [_record(images=["c.png", str(absolute)])])
    (sample,) = load_jsonl_dataset(path, image_root=root)
    assert sample.images == [str(root / "c.png"), str(absolute)]


def test_auto_detects_pixel_and_norm1000(tmp_path: Path) -> None:
    pixel = _write(tmp_path, [_record(objects=[{"desc": "x", "bbox_2d": [0.5, 0, 20, 20]}])])
    # 999 * 0.5 / 111 == 4.5 -> 4: Python's round, half to even, as in stagectl.detection.coords
    assert load_jsonl_dataset(pixel, box_format="auto")[0].objects[0].bbox_2d == (4, 0, 180, 363)
    bins = _write(tmp_path, [_record(objects=[{"desc": "x", "bbox_2d": [0, 0, 500, 500]}])])
    assert load_jsonl_dataset(bins, box_format="auto")[0].objects[0].bbox_2d == (0, 0, 500, 500)


def test_auto_refuses_to_guess(tmp_path: Path) -> None:
    path = _write(tmp_path, [_record()])  # [10, 5, 40, 30] fits both readings
    with pytest.raises(DataError, match=r"every box fits both\): set data.box_format: pixel or norm1000"):
        load_jsonl_dataset(path, box_format="auto")


def test_a_coordexp_coord_jsonl_line_loads(tmp_path: Path) -> None:
    """CoordExp's data contract (its JSONL contract document) allows a `summary` string and a `metadata` object on a
    line; each such line was refused as `unknown field 'summary'`."""
    tokens = ["<|coord_100|>", "<|coord_120|>", "<|coord_180|>", "<|coord_200|>"]
    line = _record(
        objects=[{"bbox_2d": tokens, "desc": "tool cabinet"}],
        summary="tool cabinet x1",
        metadata={"source": "lvis", "id": 7},
    )
    (sample,) = load_jsonl_dataset(_write(tmp_path, [line]), box_format="auto")
    assert sample.objects[0].bbox_2d == (100, 120, 180, 200)


def test_a_line_of_upstreams_coco_converter_loads(tmp_path: Path) -> None:
    """CoordExp's COCO converter writes provenance (`file_name`; `category_name`, `coco_ann_id` per object):
    every such line was refused as `unknown field 'file_name'`."""
    line = _record(
        objects=[
            {
                "bbox_2d": [10.5, 20.0, 100.25, 50.0],
                "desc": "person",
                "category_id": 1,
                "category_name": "person",
                "coco_ann_id": 42,
                "object_id": "obj-1",
            }
        ],
        image_id=139,
        file_name="img/a.png",
        metadata={"source": "coco2017", "split": "val"},
    )
    (sample,) = load_jsonl_dataset(_write(tmp_path, [line]), box_format="pixel")
    assert (sample.image_id, sample.objects[0].category_id, sample.objects[0].desc) == (139, 1, "person")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"summary": ["a"]}, "summary must be a string, got list"),
        ({"metadata": "x"}, "metadata must be an object, got str"),
        ({"file_name": 3}, "file_name must be a string, got int"),
        (
            {"objects": [{"bbox_2d": [1, 2, 3, 4], "desc": "a", "coco_ann_id": [1]}]},
            "objects[0]: coco_ann_id must be an integer or a string, got [1]",
        ),
        (
            {"objects": [{"bbox_2d": [1, 2, 3, 4], "desc": "a", "category_name": None}]},
            "objects[0]: category_name must be a string, got None",
        ),
        (
            {"objects": [{"poly": [1, 2, 3, 4, 5, 6], "poly_points": 3, "desc": "roof"}]},
            "objects[0]: a poly geometry (CoordExp's polygon) is not read: stagectl trains boxes",
        ),
    ],
)
def test_coordexp_fields_are_checked(tmp_path: Path, change: dict[str, Any], expected: str) -> None:
    with pytest.raises(DataError) as info:
        load_jsonl_dataset(_write(tmp_path, [_record(**change)]), box_format="pixel")
    assert f"data.jsonl:1: {expected}" in str(info.value)


def test_auto_refuses_integers_up_to_1000(tmp_path: Path) -> None:
    """A 0..1000 normalised file (round(1000 * x / W)) with one 1000 on images wider than 1000 pixels: every box
    also fits as pixels, and `auto` read the whole file as pixels, shrinking every box silently."""
    wide = {"width": 1280, "height": 1000}
    path = _write(
        tmp_path,
        [
            _record(**wide, objects=[{"desc": "dog", "bbox_2d": [100, 200, 500, 1000]}]),
            _record(**wide, objects=[{"desc": "cat", "bbox_2d": [10, 20, 300, 400]}]),
        ],
    )
    with pytest.raises(DataError, match=r"cannot tell pixel boxes from a 0\.\.1000 normalised scale"):
        load_jsonl_dataset(path, box_format="auto")
    assert load_jsonl_dataset(path, box_format="pixel")[0].objects[0].bbox_2d == (78, 200, 391, 999)
    above = _write(tmp_path, [_record(**wide, objects=[{"desc": "dog", "bbox_2d": [100, 200, 1001, 999]}])])
    assert load_jsonl_dataset(above, box_format="auto")[0].objects[0].bbox_2d[2] == 782  # above 1000: pixels


_GOOD_OBJECT = {"desc": "red circle", "bbox_2d": [10, 5, 40, 30]}

BAD_LINES: list[tuple[str, Any, str]] = [
    ("malformed JSON", '{"images": ["img/a.png"], "width": 112', "malformed JSON"),
    ("not an object", "[1, 2, 3]", "must be a JSON object"),
    ("missing field", {k: v for k, v in _record().items() if k != "height"}, "missing field 'height'"),
    ("extra field", _record(label="x"), "unknown field 'label'"),
    ("missing object field", _record(objects=[{"desc": "x"}]), "objects[0]: missing field 'bbox_2d'"),
    ("extra object field", _record(objects=[{**_GOOD_OBJECT, "score": 1}]), "unknown field 'score'"),
    ("box of 3 numbers", _record(objects=[{"desc": "x", "bbox_2d": [1, 2, 3]}]), "must be 4 numbers"),
    ("box with a string", _record(objects=[{"desc": "x", "bbox_2d": [1, 2, "3", 4]}]), "must be 4 numbers"),
    ("box with a bool", _record(objects=[{"desc": "x", "bbox_2d": [1, 2, True, 4]}]), "must be 4 numbers"),
    (
        "box with NaN",
        '{"images": ["img/a.png"], "width": 9, "height": 9, '
        '"objects": [{"desc": "x", "bbox_2d": [1, 2, NaN, 4]}]}',
        "must be 4 numbers",
    ),
    ("x2 < x1", _record(objects=[{"desc": "x", "bbox_2d": [40, 5, 10, 30]}]), "x2 < x1"),
    ("y2 < y1", _record(objects=[{"desc": "x", "bbox_2d": [10, 30, 40, 5]}]), "y2 < y1"),
    (
        "box outside",
        _record(objects=[{"desc": "x", "bbox_2d": [10, 5, 113, 30]}]),
        "outside the 112x56 image",
    ),
    (
        "negative box",
        _record(objects=[{"desc": "x", "bbox_2d": [-1, 5, 10, 30]}]),
        "outside the 112x56 image",
    ),
    ("empty desc", _record(objects=[{"desc": "  ", "bbox_2d": [1, 2, 3, 4]}]), "desc must be a non-empty"),
    (
        "desc not a string",
        _record(objects=[{"desc": 3, "bbox_2d": [1, 2, 3, 4]}]),
        "desc must be a non-empty",
    ),
    (
        "desc spells a coordinate token",
        _record(objects=[{"desc": "<|coord_5|>", "bbox_2d": [1, 2, 3, 4]}]),
        "objects[0]: desc '<|coord_5|>' spells a special token",
    ),
    (
        "desc spells end of turn",
        _record(objects=[{"desc": "cat<|im_end|>", "bbox_2d": [1, 2, 3, 4]}]),
        "would encode as that token, not as a label",
    ),
    ("missing image", _record(images=["img/nope.png"]), "image not found: "),
    ("no images", _record(images=[]), "images must be a non-empty list"),
    ("zero width", _record(width=0), "width must be a positive integer"),
    ("float height", _record(height=5.5), "height must be a positive integer"),
    ("objects not a list", _record(objects={"a": 1}), "objects must be a list"),
]


@pytest.mark.parametrize(
    ("line", "expected"), [case[1:] for case in BAD_LINES], ids=[c[0] for c in BAD_LINES]
)
def test_bad_line_reports_file_and_line(tmp_path: Path, line: Any, expected: str) -> None:
    path = _write(tmp_path, [_record(), line])
    with pytest.raises(DataError) as info:
        load_jsonl_dataset(path, box_format="pixel")
    assert str(info.value).startswith(f"{path}:2: ")
    assert expected in str(info.value)
    assert info.value.num_errors == 1
    assert isinstance(info.value, ValueError)


def test_norm1000_box_out_of_range(tmp_path: Path) -> None:
    path = _write(tmp_path, [_record(objects=[{"desc": "x", "bbox_2d": [0, 0, 1000, 10]}])])
    with pytest.raises(DataError) as info:
        load_jsonl_dataset(path)
    assert str(info.value).startswith(f"{path}:1: objects[0]: bbox_2d [0, 0, 1000, 10] is outside the image")


def test_norm1000_box_must_be_integers(tmp_path: Path) -> None:
    path = _write(tmp_path, [_record(objects=[{"desc": "x", "bbox_2d": [0, 0, 10.5, 10]}])])
    with pytest.raises(DataError, match=r"integers in 0\.\.999"):
        load_jsonl_dataset(path)


def test_all_bad_lines_are_collected_in_order_and_capped(tmp_path: Path) -> None:
    bad = _record(width=-1)
    path = _write(tmp_path, [_record(), bad, "{", *[bad] * 30])
    with pytest.raises(DataError) as info:
        load_jsonl_dataset(path, box_format="pixel")
    error = info.value
    assert error.num_errors == 32
    assert len(error.errors) == MAX_REPORTED_ERRORS
    assert error.errors[0].startswith(f"{path}:2: width")
    assert error.errors[1].startswith(f"{path}:3: malformed JSON")
    assert error.errors[-1].startswith(f"{path}:{MAX_REPORTED_ERRORS + 1}: ")
    assert str(error).endswith(f"... and {32 - MAX_REPORTED_ERRORS} more bad lines")


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        load_jsonl_dataset(tmp_path / "absent.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="no samples"):
        load_jsonl_dataset(empty)


def test_a_missing_file_says_where_it_was_looked_for_and_how_to_write_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train-ab` / `eval` on a config whose JSONL is not there (examples/coco/train_ab.yaml before `convert
    coco`) said only `data/coco/train2017.jsonl: no such file`; doctor said where a relative path is read
    from and how to write the file. The loader's error, which train-ab and eval print, says it now too."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as missing:
        load_jsonl_dataset("data/coco/train2017.jsonl")
    (message,) = missing.value.errors
    assert message.startswith("data/coco/train2017.jsonl: no such file")
    assert f"relative paths are read from the working directory, {tmp_path}" in message
    assert "stagectl convert coco INSTANCES.json --images DIR --out data/coco/train2017.jsonl" in message
    absolute = tmp_path / "absent.jsonl"
    with pytest.raises(DataError) as missing:
        load_jsonl_dataset(absolute)
    assert "working directory" not in str(missing.value) and "--out " + str(absolute) in str(missing.value)
    (tmp_path / "a_dir").mkdir()
    with pytest.raises(DataError, match="a_dir: is a directory, not a JSONL file"):
        load_jsonl_dataset(tmp_path / "a_dir")


def test_a_byte_order_mark_and_crlf_line_ends_are_read(tmp_path: Path) -> None:
    """A file saved by a Windows editor: BOM + CRLF (the BOM was `malformed JSON: Unexpected UTF-8 BOM
    (decode using utf-8-sig)` at line 1); a BOM anywhere else is still a line error."""
    path = _write(tmp_path, [_record(), _record()])
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes().replace(b"\n", b"\r\n"))
    samples = load_jsonl_dataset(path, box_format="pixel")
    assert [s.objects[0].bbox_2d for s in samples] == [(90, 91, 360, 545)] * 2
    lines = path.read_bytes().split(b"\r\n")
    path.write_bytes(lines[0] + b"\n\xef\xbb\xbf" + lines[1] + b"\n")
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}:2: malformed JSON"):
        load_jsonl_dataset(path, box_format="pixel")


@pytest.mark.parametrize(
    ("tail", "where"),
    [
        ("", "(the end of the line: a truncated line?)"),  # a line cut short, e.g. by a crash while writing
        (", oops}", ""),  # a bare word where a key belongs
    ],
)
def test_malformed_json_names_the_real_column(tmp_path: Path, tail: str, where: str) -> None:
    good = json.dumps(_record())
    line = good[:-1] + tail  # drop the closing brace: the error is at len(good), or at the bare word
    path = _write(tmp_path, [_record(), line])
    column = len(good) if not tail else len(good) - 1 + len(", ") + 1
    with pytest.raises(DataError) as info:
        load_jsonl_dataset(path)
    (message,) = info.value.errors
    assert message.startswith(f"{path}:2: malformed JSON")
    assert f"(column {column}{' ' + where if where else ''})" in message, message
    assert column > 100  # not "column 1"


# ------------------------------------------------------------------ upstream (CoordExp) coordinate tokens

TOKEN_LINE = (
    '{"images": ["img/a.png"], "width": 112, "height": 56, "objects": [{"desc": "red circle", '
    '"bbox_2d": ["<|coord_10|>", "<|coord_5|>", "<|coord_400|>", "<|coord_999|>"]}]}'
)


@pytest.mark.parametrize("box_format", ["norm1000", "auto"])
def test_coord_token_boxes_load_as_bins(tmp_path: Path, box_format: Any) -> None:
    path = _write(tmp_path, [TOKEN_LINE])  # a line as CoordExp's converter writes it (*.coord.jsonl)
    (sample,) = load_jsonl_dataset(path, box_format=box_format)
    assert sample.objects == [DetObject("red circle", (10, 5, 400, 999))]


def test_coord_tokens_and_numbers_give_the_same_sample(tmp_path: Path) -> None:
    tokens = load_jsonl_dataset(_write(tmp_path, [TOKEN_LINE]))
    numbers = _record(objects=[{"desc": "red circle", "bbox_2d": [10, 5, 400, 999]}])
    assert tokens == load_jsonl_dataset(_write(tmp_path, [numbers]))


@pytest.mark.parametrize(
    ("box", "expected"),
    [
        (
            ["<|coord_1|>", "<|coord_2|>", "<|coord_1000|>", "<|coord_3|>"],
            "bbox_2d[2] '<|coord_1000|>' is not a coordinate token",
        ),
        (
            ["<|coord_1|>", "<|coord_2|>", "<coord_3>", "<|coord_4|>"],
            "bbox_2d[2] '<coord_3>' is not a coordinate token",
        ),
        (["<|coord_1|>", "<|coord_-2|>", "<|coord_3|>", "<|coord_4|>"], "bbox_2d[1] '<|coord_-2|>'"),
        (["<|coord_1|>", 2, "<|coord_3|>", "<|coord_4|>"], "mixes numbers and <|coord_k|> tokens"),
        (["<|coord_5|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>"], "has x2 < x1"),
        (["<|coord_1|>", "<|coord_2|>", "<|coord_3|>"], "4 numbers [x1, y1, x2, y2] or 4 <|coord_k|> tokens"),
    ],
)
def test_bad_coord_tokens_are_named(tmp_path: Path, box: list[Any], expected: str) -> None:
    path = _write(tmp_path, [_record(objects=[{"desc": "x", "bbox_2d": box}])])
    with pytest.raises(DataError) as info:
        load_jsonl_dataset(path)
    assert str(info.value).startswith(f"{path}:1: objects[0]: ")
    assert expected in str(info.value)


def test_coord_tokens_are_refused_as_pixel_boxes(tmp_path: Path) -> None:
    path = _write(tmp_path, [TOKEN_LINE])
    with pytest.raises(
        DataError, match=r"<\|coord_k\|> tokens, which are norm-1000 bins.*box_format: norm1000"
    ):
        load_jsonl_dataset(path, box_format="pixel")


def test_convert_coco_output_without_pixel_box_format_says_so(tmp_path: Path) -> None:
    # what `stagectl convert coco` writes: pixel xyxy floats within the image
    line = _record(width=100, height=80, objects=[{"desc": "dog", "bbox_2d": [43.39, 11.1, 82.74, 50.45]}])
    path = _write(tmp_path, [line])
    with pytest.raises(DataError) as info:
        load_jsonl_dataset(path)  # the norm1000 default
    message = str(info.value)
    assert (
        "these look like pixel boxes (as `stagectl convert coco` writes them): set data.box_format: pixel"
        in message
    )
    assert message.startswith(f"{path}:1: objects[0]: bbox_2d [43.39, 11.1, 82.74, 50.45]")


def test_norm1000_boxes_read_as_pixels_say_so(tmp_path: Path) -> None:
    # what `stagectl demo-data` writes (bins), loaded under a pixel config such as the COCO example's
    line = _record(width=112, height=112, objects=[{"desc": "dog", "bbox_2d": [432, 100, 600, 800]}])
    path = _write(tmp_path, [line])
    with pytest.raises(DataError) as info:
        load_jsonl_dataset(path, box_format="pixel")
    assert str(info.value).startswith(
        f"{path}:1: objects[0]: bbox_2d [432, 100, 600, 800] is outside the 112x112 image: these look like "
        "norm-1000 boxes (integers in 0..999, as `stagectl demo-data` writes them): set data.box_format: norm1000"
    )
    # a box that fits neither reading gets no hint
    (tmp_path / "far").mkdir()
    far = _write(
        tmp_path / "far",
        [_record(width=112, height=112, objects=[{"desc": "d", "bbox_2d": [0, 0, 5000, 9]}])],
    )
    with pytest.raises(DataError, match=r"is outside the 112x112 image$"):
        load_jsonl_dataset(far, box_format="pixel")


def test_declared_size_must_match_the_first_image_when_images_are_verified(tmp_path: Path) -> None:
    """width/height are what every box is scaled against: with `verify_images` (train-ab, eval, doctor) a
    line whose first image has another size is a line error naming the file, the line and both sizes."""
    from PIL import Image

    path = _write(tmp_path, [_record(width=112, height=56), _record(width=224, height=224), _record()])
    Image.new("RGB", (112, 56)).save(tmp_path / "img" / "a.png")
    assert len(load_jsonl_dataset(path, box_format="pixel")) == 3  # unverified: the files are not opened
    with pytest.raises(DataError) as caught:
        load_jsonl_dataset(path, box_format="pixel", verify_images=True)
    assert caught.value.errors == [
        f"{path}:2: image {tmp_path / 'img' / 'a.png'} is 112x56 but the line says width 224, height 224: "
        "every box would be scaled against the wrong size; write the image's real size (width 112, height 56) "
        "and boxes that refer to it"
    ]
