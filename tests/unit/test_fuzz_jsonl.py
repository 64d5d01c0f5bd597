"""Fuzzing `load_jsonl_dataset`: corrupted JSONL (random bytes, mutations of a valid file, broken
encodings, deep nesting, huge numbers) and corrupted images either load or raise a `DataError` whose
every entry is `file:line: what is wrong` (or `file: ...` for whole-file problems), never another
exception, and the message can always be printed.

Examples per property: 150 under `STAGECTL_FUZZ_PROFILE=full`, a tenth (at least 20) by default
(`tests.helpers.fuzz_examples`); `STAGECTL_FUZZ_EXAMPLES=5000` for a longer run.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from stagectl.data.jsonl import DataError, load_jsonl_dataset
from tests.helpers import fuzz_examples

SETTINGS = settings(
    max_examples=fuzz_examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
GOOD = {
    "images": ["a.png"],
    "width": 8,
    "height": 8,
    "objects": [{"desc": "red circle", "bbox_2d": [1, 2, 5, 6]}],
}


def _png(size: tuple[int, int] = (8, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = _png()


def check(tmp_path: Path, data: bytes, *, verify_images: bool = False) -> None:
    (tmp_path / "a.png").write_bytes(PNG)
    path = tmp_path / "data.jsonl"
    path.write_bytes(data)
    line_re = re.compile(rf"^{re.escape(str(path))}(:\d+)?: \S")
    try:
        load_jsonl_dataset(path, box_format="auto", verify_images=verify_images)
    except DataError as exc:
        assert exc.errors and exc.num_errors >= len(exc.errors)
        num_lines = data.count(b"\n") + 1
        for entry in exc.errors:
            assert line_re.match(entry), entry
            where = entry[len(str(path)) :].split(":")[1]
            assert not where.isdigit() or 1 <= int(where) <= num_lines, entry
        str(exc).encode("utf-8")  # printable: no lone surrogates in the message


@SETTINGS
@given(data=st.binary(max_size=300))
def test_random_bytes(tmp_path: Path, data: bytes) -> None:
    check(tmp_path, data)


MUTATION = st.tuples(
    st.sampled_from(["delete", "insert", "replace", "duplicate_line", "truncate"]),
    st.integers(0, 10**6),
    st.one_of(st.sampled_from(list(b'{}[]:,"\\\n\r\x00\xff\xc3 0123456789-.eE')), st.integers(0, 255)),
)


@SETTINGS
@given(
    mutations=st.lists(MUTATION, min_size=1, max_size=8),
    num_lines=st.integers(1, 4),
    verify_images=st.booleans(),
)
def test_mutated_valid_files(
    tmp_path: Path, mutations: list[tuple[str, int, int]], num_lines: int, verify_images: bool
) -> None:
    data = bytearray(b"".join(json.dumps(GOOD).encode() + b"\n" for _ in range(num_lines)))
    for op, where, byte in mutations:
        at = where % (len(data) + 1)
        if op == "delete" and at < len(data):
            del data[at]
        elif op == "insert":
            data.insert(at, byte)
        elif op == "replace" and at < len(data):
            data[at] = byte
        elif op == "duplicate_line":
            data += data[: data.find(b"\n") + 1]
        elif op == "truncate":
            del data[at:]
    check(tmp_path, bytes(data), verify_images=verify_images)


JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8)
)
ANY_JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
FIELD = st.sampled_from(["images", "width", "height", "objects", "desc", "bbox_2d", "extra"])


@SETTINGS
@given(record=st.dictionaries(FIELD, ANY_JSON, max_size=5), good_fields=st.integers(0, 15))
def test_wrongly_typed_fields(tmp_path: Path, record: dict, good_fields: int) -> None:
    merged = {k: v for i, (k, v) in enumerate(GOOD.items()) if good_fields >> i & 1}
    merged.update(record)
    check(tmp_path, json.dumps(merged).encode() + b"\n")


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b'{"a\xff": 1}\n', "not UTF-8 text (byte 4 of the line)"),
        (b"[" * 100_000 + b"\n", "malformed JSON"),
        (
            b'{"images": ["a.png"], "width": ' + b"9" * 5000 + b', "height": 1, "objects": []}\n',
            "malformed JSON",
        ),
        (b'{"images": ["\\ud800.png"], "width": 8, "height": 8, "objects": []}\n', "lone surrogate"),
        (b'{"images": ["a\\u0000.png"], "width": 8, "height": 8, "objects": []}\n', "non-empty path strings"),
    ],
)
def test_hostile_lines_are_line_errors(tmp_path: Path, line: bytes, error: str) -> None:
    (tmp_path / "a.png").write_bytes(PNG)
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + line)
    with pytest.raises(DataError) as info:
        load_jsonl_dataset(path)
    assert info.value.errors[0].startswith(f"{path}:2: ") and error in info.value.errors[0]


IMAGE_MUTATION = st.tuples(
    st.sampled_from(["truncate", "flip", "zero"]), st.integers(0, 10**6), st.integers(1, 255)
)


@SETTINGS
@given(mutations=st.lists(IMAGE_MUTATION, min_size=1, max_size=4), size=st.sampled_from([(8, 8), (40, 30)]))
def test_corrupted_images_are_reported_at_their_line(
    tmp_path: Path, mutations: list[tuple[str, int, int]], size: tuple[int, int]
) -> None:
    data = bytearray(_png(size))
    for op, where, value in mutations:
        at = where % len(data) if data else 0
        if op == "truncate":
            del data[max(at, 1) :]
        elif op == "flip" and data:
            data[at] ^= value
        elif op == "zero" and data:
            data[at : at + value] = bytes(len(data[at : at + value]))
    (tmp_path / "a.png").write_bytes(PNG)
    (tmp_path / "bad.png").write_bytes(bytes(data))
    path = tmp_path / "data.jsonl"
    bad = {**GOOD, "images": ["bad.png"], "width": size[0], "height": size[1]}
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n")
    try:
        samples = load_jsonl_dataset(path, verify_images=True)
    except DataError as exc:
        assert exc.errors == [exc.errors[0]] and exc.errors[0].startswith(f"{path}:2: image "), exc.errors
        assert "bad.png" in exc.errors[0]
        return
    # pillow found nothing wrong with the structure: then the file decodes
    assert len(samples) == 2
    with Image.open(samples[1].images[0]) as image:
        image.convert("RGB")


def test_a_corrupt_image_is_only_checked_when_asked(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"not an image")
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    assert len(load_jsonl_dataset(path)) == 1  # the default stays a cheap stat
    with pytest.raises(
        DataError, match=rf"^{re.escape(str(path))}:1: image .*a\.png is not a readable image"
    ):
        load_jsonl_dataset(path, verify_images=True)
