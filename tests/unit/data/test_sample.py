"""The norm-1000 box codec and the sample's JSON form."""

from __future__ import annotations

import pytest

from stagectl.data.sample import (
    DetectionSample,
    DetObject,
    bins_to_pixel_box,
    pixel_box_to_bins,
)


def test_full_image_box_maps_to_full_bin_range() -> None:
    assert pixel_box_to_bins((0, 0, 639, 479), 640, 480) == (0, 0, 999, 999)


@pytest.mark.parametrize(
    ("x", "width", "expected"),
    [(0, 640, 0), (639, 640, 999), (320, 640, round(999 * 320 / 639)), (37, 112, 333), (-5, 112, 0)],
)
def test_bin_formula_rounds_and_clamps(x: float, width: int, expected: int) -> None:
    assert pixel_box_to_bins((x, x, x, x), width, width)[0] == expected


def test_exclusive_right_edge_clamps_to_last_bin() -> None:
    assert pixel_box_to_bins((10, 10, 640, 480), 640, 480)[2:] == (999, 999)


@pytest.mark.parametrize("width", [112, 224, 640, 1000, 1920])
def test_decode_of_encode_is_within_half_a_bin(width: int) -> None:
    half_bin_px = 0.5 * (width - 1) / 999
    for x in range(width):
        decoded = bins_to_pixel_box(pixel_box_to_bins((x, 0, x, 0), width, 2), width, 2)[0]
        assert abs(decoded - x) <= half_bin_px + 1e-9


def test_112_pixel_images_round_trip_exactly() -> None:
    # 999 / 111 == 9, so every pixel of a 112-wide image has its own bin.
    for x in range(112):
        box = pixel_box_to_bins((x, x, x, x), 112, 112)
        assert box[0] == 9 * x
        assert bins_to_pixel_box(box, 112, 112)[0] == pytest.approx(x)


def test_to_json_dict() -> None:
    sample = DetectionSample(
        images=["/data/a.png"], width=8, height=6, objects=[DetObject("red circle", (1, 2, 3, 4))]
    )
    assert sample.to_json_dict() == {
        "images": ["/data/a.png"],
        "width": 8,
        "height": 6,
        "objects": [{"desc": "red circle", "bbox_2d": [1, 2, 3, 4]}],
    }


def test_codec_agrees_with_detection_coords() -> None:
    coords = pytest.importorskip("stagectl.detection.coords")
    for size in (2, 112, 113, 640):
        for x in [*range(size), 0.5, 4.5, size - 0.5, size]:
            box = (x, x, x, x)
            assert pixel_box_to_bins(box, size, size) == coords.box_to_bins(box, size, size)
        assert bins_to_pixel_box((0, 1, 500, 999), size, size) == coords.bins_to_box(
            (0, 1, 500, 999), size, size
        )
