"""The memory estimate's `model_shape` on a checkpoint whose config.json does not parse names that file
(validate-config --gpu-memory-gb printed only "Expecting property name ...: line 2 column 1 (char 2)")."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagectl.memory.from_config import model_shape


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{\n", "Expecting property name enclosed in double quotes: line 2 column 1 (char 2)"),
        (b"\xff\xfe", "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"),
    ],
)
def test_a_config_json_that_does_not_parse_is_named(tmp_path: Path, content: bytes, why: str) -> None:
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError) as info:
        model_shape(str(tmp_path))
    assert str(info.value) == f"{tmp_path / 'config.json'}: not valid JSON ({why})"
