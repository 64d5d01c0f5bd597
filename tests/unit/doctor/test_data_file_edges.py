"""`stagectl doctor`'s data lines on files with no box to read (negatives only, empty, every line broken) and a
data path that is a directory: one true line each, never a format advice about boxes that are not there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from stagectl.config.model_data import DataConfig
from stagectl.doctor.data_checks import check_box_format, load_samples


def _data(path: Path, box_format: str) -> DataConfig:
    return DataConfig.model_validate({"train_jsonl": str(path), "box_format": box_format})


def _negatives(tmp_path: Path) -> Path:
    Image.new("RGB", (10, 10)).save(tmp_path / "a.png")
    path = tmp_path / "neg.jsonl"
    path.write_text(json.dumps({"images": ["a.png"], "width": 10, "height": 10, "objects": []}) + "\n")
    return path


@pytest.mark.parametrize("box_format", ["pixel", "norm1000", "auto"])
@pytest.mark.parametrize("content", ["negatives", "", "not json\n", '{"images": [\n'])
def test_a_file_without_boxes_gets_no_box_format_advice(
    tmp_path: Path, content: str, box_format: str
) -> None:
    """A pixel-configured file of negatives loads, but the check failed it: "some boxes only fit the norm1000
    reading | fix: set data.box_format: norm1000" (no box at all); empty and broken files got the same second
    FAIL next to data.file's."""
    if content == "negatives":
        path = _negatives(tmp_path)
    else:
        path = tmp_path / "train.jsonl"
        path.write_text(content)
    (line,) = check_box_format(_data(path, box_format))
    assert line.status == "skip", line
    assert line.message == f"{path} has no box to read (no objects, or no line parses: see data.file)"
    if content == "negatives":
        samples, (file_line,) = load_samples(_data(path, box_format))
        assert file_line.status == "ok" and samples is not None and len(samples) == 1


def test_a_data_path_that_is_a_directory_is_named_as_one(tmp_path: Path) -> None:
    """It said "no such file" and advised writing the file with `convert coco` there (which cannot)."""
    folder = tmp_path / "train.jsonl"
    folder.mkdir()
    samples, (line,) = load_samples(_data(folder, "pixel"))
    assert samples is None and line.status == "fail"
    assert line.message == f"{folder}: is a directory, not a JSONL file"
    assert line.fix == "point data.train_jsonl at the JSONL file in it"
