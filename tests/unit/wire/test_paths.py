"""Which files the server reads: image roots, `..`, symlink escapes, URLs, inline data URLs."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from stagectl.wire.paths import PathRefused, decode_data_url, load_image, resolve_under_roots


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    Image.new("RGB", (8, 6), (255, 0, 0)).save(root / "sub" / "ok.png")
    outside = tmp_path / "outside"
    outside.mkdir()
    Image.new("RGB", (4, 4)).save(outside / "secret.png")
    (root / "escape.png").symlink_to(outside / "secret.png")
    (root / "inside_link.png").symlink_to(root / "sub" / "ok.png")
    return tmp_path


def test_image_under_root_loads(tree: Path) -> None:
    image = load_image(str(tree / "root" / "sub" / "ok.png"), [tree / "root"])
    assert image.size == (8, 6) and image.mode == "RGB"
    assert load_image(str(tree / "root" / "inside_link.png"), [tree / "root"]).size == (8, 6)


@pytest.mark.parametrize(
    ("relative", "error"),
    [
        ("outside/secret.png", "resolves outside"),
        ("root/escape.png", "resolves outside"),  # a symlink inside the root pointing out of it
        ("root/sub/../sub/ok.png", "'..' is not allowed"),
        ("root/../outside/secret.png", "'..' is not allowed"),
    ],
)
def test_paths_outside_the_roots_are_refused(tree: Path, relative: str, error: str) -> None:
    with pytest.raises(PathRefused, match=error):
        load_image(str(tree / relative), [tree / "root"])


@pytest.mark.parametrize(
    "url", ["http://example.com/a.png", "https://x/y.jpg", "file:///etc/passwd", "s3://b/k"]
)
def test_urls_are_refused(tree: Path, url: str) -> None:
    with pytest.raises(PathRefused, match="URLs are not fetched"):
        load_image(url, [tree / "root"])


def test_no_roots_refuses_every_path(tree: Path) -> None:
    with pytest.raises(PathRefused, match="image_roots is empty"):
        load_image(str(tree / "root" / "sub" / "ok.png"), [])


def test_missing_file_and_non_image(tree: Path) -> None:
    with pytest.raises(PathRefused, match="no such file"):
        load_image(str(tree / "root" / "nope.png"), [tree / "root"])
    (tree / "root" / "text.png").write_text("hello")
    with pytest.raises(PathRefused, match="not a readable image"):
        load_image(str(tree / "root" / "text.png"), [tree / "root"])


def test_an_image_the_system_cannot_open_is_refused_not_an_error(tree: Path) -> None:
    """A file name longer than the file system takes (ENAMETOOLONG from the `is_file` check; a permission or
    I/O error the same way) escaped as OSError: the call was a 500 with a traceback in the server's log."""
    name = str(tree / "root" / ("a" * 5000 + ".png"))
    with pytest.raises(PathRefused, match=r"cannot be read \(File name too long\)"):
        load_image(name, [tree / "root"])


def test_an_image_past_the_qwen_vl_aspect_ratio_is_refused_before_any_batch(tree: Path) -> None:
    """vLLM's processor refused a 2000x4 image inside its batched generate, failing every call in the batch
    (each answered 400 naming that image); the server now refuses that one request up front."""
    Image.new("RGB", (1000, 5)).save(tree / "root" / "ratio_200.png")  # the processors' limit itself
    Image.new("RGB", (4, 2000)).save(tree / "root" / "tall.png")
    assert load_image(str(tree / "root" / "ratio_200.png"), [tree / "root"]).size == (1000, 5)
    with pytest.raises(
        PathRefused, match=r"tall\.png'?: 4x2000 is more than 200 times as long as it is wide"
    ):
        load_image(str(tree / "root" / "tall.png"), [tree / "root"])


def test_inline_data_url() -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (5, 7), (0, 255, 0)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    image = load_image(url, [])  # allowed without any roots
    assert image.size == (5, 7) and image.getpixel((0, 0)) == (0, 255, 0)


def test_inline_data_url_that_is_no_image_names_no_python_object() -> None:
    url = "data:image/png;base64," + base64.b64encode(b"hello, not a png").decode()
    with pytest.raises(PathRefused) as refused:
        load_image(url, [])
    assert str(refused.value) == "inline image: not a readable image (no image format recognised)"


@pytest.mark.parametrize(
    "url", ["data:image/png,rawbytes", "data:image/png;base64,!!!notbase64", "data:text/plain;base64,aGk="]
)
def test_bad_data_urls(url: str) -> None:
    with pytest.raises(PathRefused):
        decode_data_url(url)


def test_resolve_returns_the_real_path(tree: Path) -> None:
    resolved = resolve_under_roots(
        str(tree / "root" / "inside_link.png"), [tree / "root"], what="image", roots_key="k"
    )
    assert resolved == (tree / "root" / "sub" / "ok.png").resolve()
