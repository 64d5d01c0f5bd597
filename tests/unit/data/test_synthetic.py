"""The synthetic shapes data set: deterministic, idempotent, and its boxes are exactly tight."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stagectl.data.jsonl import load_jsonl_dataset
from stagectl.data.sample import DetectionSample
from stagectl.data.synthetic import (
    BACKGROUND,
    COLORS,
    SHAPES,
    default_synthetic_dir,
    generate_synthetic,
    synthetic_params,
)
from stagectl.files import host_tag


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _pixel_box(sample: DetectionSample, index: int) -> tuple[int, int, int, int]:
    x1, y1, x2, y2 = (round(v) for v in sample.pixel_boxes()[index])
    return x1, y1, x2, y2


def test_same_seed_writes_identical_files(tmp_path: Path) -> None:
    first = generate_synthetic(20, seed=7, out_dir=tmp_path / "a")
    second = generate_synthetic(20, seed=7, out_dir=tmp_path / "b")
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert [s.objects for s in first] == [s.objects for s in second]
    other = generate_synthetic(20, seed=8, out_dir=tmp_path / "c")
    assert [s.objects for s in other] != [s.objects for s in first]


def test_sample_i_does_not_depend_on_num_samples(tmp_path: Path) -> None:
    small = generate_synthetic(5, seed=3, out_dir=tmp_path / "a")
    large = generate_synthetic(12, seed=3, out_dir=tmp_path / "b")
    assert [s.objects for s in small] == [s.objects for s in large[:5]]


def test_eval_split_is_a_different_stream(tmp_path: Path) -> None:
    train = generate_synthetic(20, seed=1, out_dir=tmp_path)
    held_out = generate_synthetic(20, seed=1, out_dir=tmp_path, split="eval")
    assert [s.objects for s in train] != [s.objects for s in held_out]
    assert (tmp_path / "train.jsonl").is_file() and (tmp_path / "eval.jsonl").is_file()
    assert load_jsonl_dataset(tmp_path / "eval.jsonl") == held_out


def test_written_jsonl_loads_back_to_the_returned_samples(tmp_path: Path) -> None:
    samples = generate_synthetic(10, seed=0, out_dir=tmp_path)
    assert load_jsonl_dataset(tmp_path / "train.jsonl", box_format="norm1000") == samples
    assert all(Path(s.images[0]).is_absolute() and Path(s.images[0]).is_file() for s in samples)
    assert "images/train_000000.png" in (tmp_path / "train.jsonl").read_text()  # relative in the file


def test_second_call_reuses_the_files_and_changed_params_redraw(tmp_path: Path) -> None:
    first = generate_synthetic(6, seed=0, out_dir=tmp_path)
    image = tmp_path / "images" / "train_000000.png"
    image.write_bytes(b"marker")  # survives only if the second call draws nothing
    assert generate_synthetic(6, seed=0, out_dir=tmp_path) == first
    assert image.read_bytes() == b"marker"
    changed = generate_synthetic(6, seed=1, out_dir=tmp_path)
    assert changed != first
    assert image.read_bytes().startswith(b"\x89PNG")
    assert load_jsonl_dataset(tmp_path / "train.jsonl") == changed


class _Interrupted(BaseException):
    """Stands for a Ctrl-C or a kill midway through a redraw."""


@pytest.mark.parametrize("stop_at", ["drawing", "renaming"])
def test_a_redraw_stopped_midway_leaves_no_data_set_whose_images_are_not_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_at: str
) -> None:
    """A redraw into the same dir (another seed) stopped after its first image: the earlier JSONL never names
    the new images. It was: image 0 replaced, the seed-0 JSONL and manifest kept, and the next seed-0 call
    reused them, boxes of one picture over another."""
    import stagectl.data.synthetic as synthetic

    generate_synthetic(4, seed=0, out_dir=tmp_path)
    before = _files(tmp_path)
    calls = itertools.count()
    if stop_at == "drawing":
        real_scene = synthetic.synthetic_scene

        def scene(*args: object) -> object:
            if next(calls) == 1:
                raise _Interrupted
            return real_scene(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(synthetic, "synthetic_scene", scene)
    else:
        real_replace = synthetic.os.replace

        def replace(src: object, dst: object) -> None:
            if str(dst).endswith(".png") and next(calls) == 1:
                raise _Interrupted
            real_replace(src, dst)  # type: ignore[arg-type]

        monkeypatch.setattr(synthetic.os, "replace", replace)
    with pytest.raises(_Interrupted):
        generate_synthetic(4, seed=1, out_dir=tmp_path)
    monkeypatch.undo()
    left = _files(tmp_path)
    assert not [name for name in left if name.endswith(".tmp")]
    if stop_at == "drawing":  # nothing was replaced yet: the earlier data set is whole
        assert left == before
    else:  # images were being replaced: the earlier JSONL and manifest are gone, not wrong
        assert "train.jsonl" not in left and "train.manifest.json" not in left
    again = generate_synthetic(4, seed=0, out_dir=tmp_path)
    assert _files(tmp_path) == before
    assert again == load_jsonl_dataset(tmp_path / "train.jsonl", box_format="norm1000")


def test_a_draw_removes_the_temp_images_a_killed_one_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGKILL between saving an image to its temp file and renaming it leaves the temp file: the next draw
    removes a dead process's, never a live one's (another rank drawing the same cached split)."""
    import stagectl.data.synthetic as synthetic

    monkeypatch.setattr(synthetic, "pid_alive", lambda pid: pid == 222)
    images = tmp_path / "images"
    images.mkdir()
    host = host_tag()  # this host's: another's are left to it (a shared cache)
    orphan = images / f".train_000001.png.111-{host}.tmp"
    live = images / f".train_000001.png.222-{host}.tmp"
    for path in (orphan, live):
        path.write_bytes(b"half a png")
    generate_synthetic(2, seed=0, out_dir=tmp_path)
    assert not orphan.exists()
    assert live.read_bytes() == b"half a png"


def test_a_draw_leaves_the_temp_images_of_another_host_drawing_the_same_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-node run's ranks draw the same cached split, and ~/.cache is often one shared filesystem: a
    rank on node A removed node B's temp images (B's pid is no process on A), and B's rename then failed."""
    import socket

    import stagectl.data.synthetic as synthetic

    monkeypatch.setattr(synthetic, "pid_alive", lambda pid: False)
    monkeypatch.setattr(socket, "gethostname", lambda: "node-b.cluster")
    images = tmp_path / "images"
    images.mkdir()
    theirs = synthetic._temporary_name(images / "train_000001.png")  # node B's draw, under way
    theirs.write_bytes(b"half a png")
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a.cluster")
    generate_synthetic(2, seed=0, out_dir=tmp_path)
    assert theirs.read_bytes() == b"half a png"


def test_default_directory_is_under_the_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGECTL_CACHE_DIR", str(tmp_path))
    samples = generate_synthetic(3, seed=5, image_size=56)
    expected = default_synthetic_dir(synthetic_params(3, 5, 56))
    assert expected.parent == tmp_path / "data" and expected.name.startswith("synthetic-")
    assert Path(samples[0].images[0]).parent.parent == expected
    assert default_synthetic_dir(synthetic_params(3, 6, 56)) != expected


@pytest.mark.parametrize("image_size", [112, 84])
def test_boxes_are_tight_and_descs_match_the_pixels(tmp_path: Path, image_size: int) -> None:
    samples = generate_synthetic(40, seed=11, out_dir=tmp_path, image_size=image_size)
    background = np.array(BACKGROUND)
    for sample in samples:
        assert (sample.width, sample.height) == (image_size, image_size)
        assert 1 <= len(sample.objects) <= 4
        pixels = np.asarray(Image.open(sample.images[0]).convert("RGB")).astype(int)  # [H, W, 3]
        covered = np.zeros(pixels.shape[:2], dtype=bool)
        for index, obj in enumerate(sample.objects):
            color_name, shape = obj.desc.split(" ")
            assert color_name in COLORS and shape in SHAPES
            x1, y1, x2, y2 = _pixel_box(sample, index)
            assert not covered[y1 : y2 + 1, x1 : x2 + 1].any(), "boxes overlap"
            covered[y1 : y2 + 1, x1 : x2 + 1] = True
            crop = pixels[y1 : y2 + 1, x1 : x2 + 1]
            is_shape = (crop == np.array(COLORS[color_name])).all(axis=-1)
            is_background = (crop == background).all(axis=-1)
            assert (is_shape | is_background).all(), "a box holds a pixel of another colour"
            # Tight: every edge row and column of the box holds a pixel of the shape.
            assert is_shape[0].any() and is_shape[-1].any() and is_shape[:, 0].any() and is_shape[:, -1].any()
        assert (pixels[~covered] == background).all(), "a shape pixel lies outside every box"


def test_objects_are_sorted_and_varied(tmp_path: Path) -> None:
    samples = generate_synthetic(60, seed=2, out_dir=tmp_path)
    for sample in samples:
        keys = [(obj.bbox_2d[1], obj.bbox_2d[0]) for obj in sample.objects]
        assert keys == sorted(keys)
    descs = {obj.desc for sample in samples for obj in sample.objects}
    assert descs == {f"{c} {s}" for c, s in itertools.product(COLORS, SHAPES)}
    assert {len(sample.objects) for sample in samples} == {1, 2, 3, 4}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_samples": 0}, "num_samples"),
        ({"image_size": 20}, "image_size"),
        ({"max_objects": 0}, "max_objects"),
        ({"min_objects": 0}, "min_objects"),
        ({"min_objects": 5, "max_objects": 4}, "min_objects"),
        ({"split": "test"}, "split"),
        ({"side_fraction": (0.5, 0.3)}, "side_fraction"),
        ({"side_fraction": (0.01, 0.3)}, "side_fraction"),
        ({"side_fraction": (0.3, 0.95)}, "side_fraction"),
    ],
)
def test_bad_parameters(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"num_samples": 2, "seed": 0, "out_dir": tmp_path, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate_synthetic(**args)  # type: ignore[arg-type]


def test_side_fraction_sets_the_shape_sizes(tmp_path: Path) -> None:
    big = generate_synthetic(30, seed=4, out_dir=tmp_path / "big", max_objects=2, side_fraction=(0.4, 0.5))
    for sample in big:
        for x1, y1, x2, y2 in sample.pixel_boxes():
            # the tight box of a shape drawn in a `side` square: width = side, height <= side (triangles)
            assert 0.4 * 112 - 1 <= x2 - x1 + 1 <= 0.5 * 112 + 1
            assert y2 - y1 + 1 <= 0.5 * 112 + 1
    default = generate_synthetic(30, seed=4, out_dir=tmp_path / "default", max_objects=2)
    widths = [x2 - x1 + 1 for s in default for x1, _, x2, _ in s.pixel_boxes()]
    assert max(widths) <= 0.35 * 112 + 1
    assert synthetic_params(30, 4, max_objects=2, side_fraction=(0.4, 0.5)) != synthetic_params(
        30, 4, max_objects=2
    )


def test_min_objects_sets_the_fewest_shapes_and_keeps_old_cache_keys(tmp_path: Path) -> None:
    crowded = generate_synthetic(
        20,
        seed=2,
        out_dir=tmp_path / "crowded",
        image_size=160,
        min_objects=4,
        max_objects=8,
        side_fraction=(0.2, 0.3),
    )
    counts = [len(s.objects) for s in crowded]
    assert min(counts) >= 4 and max(counts) <= 8 and max(counts) > min(counts)
    default = generate_synthetic(20, seed=2, out_dir=tmp_path / "default", image_size=160, max_objects=8)
    assert min(len(s.objects) for s in default) < 4
    # min_objects 1 (the default) is left out of the parameters: splits drawn before it keep their cache dir
    assert "min_objects" not in synthetic_params(20, 2, max_objects=8)
    assert synthetic_params(20, 2, max_objects=8, min_objects=1) == synthetic_params(20, 2, max_objects=8)
    assert synthetic_params(20, 2, max_objects=8, min_objects=4)["min_objects"] == 4
