"""`convert coco`'s --out is checked before the instances file is read (an LVIS train file takes minutes to
parse): a directory, a path under a file and the instances file itself are refused, and nothing is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagectl.data import coco
from stagectl.data.coco import CocoError, convert_coco_file

INSTANCES = {
    "images": [{"id": 1, "file_name": "a.jpg", "width": 10, "height": 10}],
    "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 3, 3]}],
    "categories": [{"id": 1, "name": "cat"}],
}


def _instances(tmp_path: Path) -> Path:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.jpg").write_bytes(b"only stat-ed")
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(INSTANCES))
    return path


def _never_read(path: Path) -> None:
    raise AssertionError(f"{path} was read before --out was checked")


@pytest.mark.parametrize(
    ("out_name", "message"),
    [
        ("taken", "--out {out}: cannot write: it is a directory; give the path of the JSONL file to write"),
        ("a_file/val.jsonl", "--out: cannot write to {parent}: {parent} is a file, not a directory"),
    ],
)
def test_an_out_that_cannot_be_written_is_refused_before_the_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out_name: str, message: str
) -> None:
    """Both were refused only after the whole file was read and converted (and the path under a file as
    "cannot write: File exists")."""
    path = _instances(tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "a_file").write_text("a file\n")
    out = tmp_path / out_name
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.setattr(coco, "read_instances", _never_read)
    with pytest.raises(CocoError) as caught:
        convert_coco_file(path, tmp_path / "images", out)
    assert caught.value.errors == [message.format(out=out, parent=out.parent)]
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_instances_file_itself_is_never_the_out(tmp_path: Path) -> None:
    """`--out instances.json` replaced the COCO file with the JSONL and exited 0: the input was gone."""
    path = _instances(tmp_path)
    alias = tmp_path / "alias.json"
    alias.symlink_to(path)
    for out in (path, alias, tmp_path / "images" / ".." / "instances.json"):
        with pytest.raises(CocoError) as caught:
            convert_coco_file(path, tmp_path / "images", out)
        assert caught.value.errors == [
            f"--out {out}: is the instances file itself, which it would replace; choose another path"
        ]
    assert json.loads(path.read_text()) == INSTANCES
    stats = convert_coco_file(path, tmp_path / "images", tmp_path / "val.jsonl")
    assert stats.num_objects == 1 and (tmp_path / "val.jsonl").is_file()
