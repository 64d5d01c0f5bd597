"""`stagectl demo-data` as a real subprocess: writes N lines that load back, deterministically."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stagectl.data.jsonl import load_jsonl_dataset

pytestmark = pytest.mark.integration

STAGECTL = Path(sys.executable).with_name("stagectl")


def _demo_data(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(STAGECTL), "demo-data", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_writes_n_lines_that_load_back(tmp_path: Path) -> None:
    out = tmp_path / "shapes"
    result = _demo_data(str(out), "--num-samples", "9", "--seed", "3", "--num-eval-samples", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("wrote 9 samples (") and str(out / "train.jsonl") in result.stdout
    assert len((out / "train.jsonl").read_text().splitlines()) == 9
    train = load_jsonl_dataset(out / "train.jsonl")
    held_out = load_jsonl_dataset(out / "eval.jsonl")
    assert (len(train), len(held_out)) == (9, 4)
    assert all(s.width == s.height == 112 and 1 <= len(s.objects) <= 4 for s in train)

    again = _demo_data(str(tmp_path / "again"), "--num-samples", "9", "--seed", "3")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again" / "train.jsonl").read_bytes() == (out / "train.jsonl").read_bytes()


def test_image_size_option(tmp_path: Path) -> None:
    result = _demo_data(str(tmp_path), "--num-samples", "2", "--seed", "0", "--image-size", "56")
    assert result.returncode == 0, result.stderr
    assert all(s.width == s.height == 56 for s in load_jsonl_dataset(tmp_path / "train.jsonl"))


def test_bad_option_fails_with_one_line(tmp_path: Path) -> None:
    result = _demo_data(str(tmp_path), "--num-samples", "0")
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and "num_samples" in result.stderr
    assert not (tmp_path / "train.jsonl").exists()


def test_side_fraction_option(tmp_path: Path) -> None:
    result = _demo_data(
        str(tmp_path), "--num-samples", "6", "--max-objects", "1", "--side-fraction", "0.5", "0.6"
    )
    assert result.returncode == 0, result.stderr
    for sample in load_jsonl_dataset(tmp_path / "train.jsonl"):
        x1, _, x2, _ = sample.pixel_boxes()[0]
        assert 0.5 * 112 - 1 <= x2 - x1 + 1 <= 0.6 * 112 + 1
    bad = _demo_data(str(tmp_path / "bad"), "--num-samples", "2", "--side-fraction", "0.6", "0.5")
    assert bad.returncode == 1 and bad.stderr.startswith("error: ") and "side_fraction" in bad.stderr
