"""Fuzzing the rollout server's image-path confinement (`stagectl.wire.paths`): whatever path or
URL a request names, `load_image` either returns an image whose real path lies under `image_roots`, or
raises `PathRefused`; nothing else, and never a file outside the roots (symlinks, `..`, `~`, FIFOs,
URLs, NUL bytes, percent-encoding, crafted data URLs and decompression bombs included).

Examples per property: 300 under `STAGECTL_FUZZ_PROFILE=full`, a tenth (at least 20) by default
(`tests.helpers.fuzz_examples`); `STAGECTL_FUZZ_EXAMPLES=5000` for a longer run.
"""

from __future__ import annotations

import base64
import io
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from stagectl.wire.paths import MAX_IMAGE_PIXELS, PathRefused, load_image, resolve_under_roots
from tests.helpers import fuzz_examples

SETTINGS = settings(
    max_examples=fuzz_examples(300),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _png(width: int = 4, height: int = 3) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(buffer, format="PNG")
    return buffer.getvalue()


def _tree(base: Path) -> tuple[Path, Path]:
    """root/{a.png, sub/b.png, out.png -> outside/secret.png, outdir -> outside/, fifo, loop -> loop}."""
    root, outside = base / "root", base / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "a.png").write_bytes(_png())
    (root / "sub" / "b.png").write_bytes(_png())
    (root / "not_an_image.png").write_bytes(b"GIF89a nope")
    (outside / "secret.png").write_bytes(_png(5, 5))
    (root / "out.png").symlink_to(outside / "secret.png")
    (root / "outdir").symlink_to(outside, target_is_directory=True)
    (root / "inner.png").symlink_to(root / "sub" / "b.png")
    (root / "loop").symlink_to(root / "loop")
    os.mkfifo(root / "fifo")
    return root, outside


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    yield _tree(tmp_path_factory.mktemp("paths"))


PARTS = st.sampled_from(
    [
        "..",
        ".",
        "",
        "a.png",
        "sub",
        "b.png",
        "out.png",
        "outdir",
        "secret.png",
        "inner.png",
        "fifo",
        "loop",
        "not_an_image.png",
        "~",
        "%2e%2e",
        "..\\",
        "a.png\x00",
        "root",
        "outside",
        "ROOT",
        "OUTSIDE",
    ]
)
PREFIXES = st.sampled_from(
    [
        "",
        "/",
        "ROOT/",
        "OUTSIDE/",
        "~/",
        "file://",
        "file:ROOT/",
        "http://127.0.0.1:9/",
        "HTTP://x/",
        "c:",
        "\\\\host\\",
    ]
)


def _is_under(path: Path, root: Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))


@SETTINGS
@given(prefix=PREFIXES, parts=st.lists(PARTS, max_size=6))
def test_paths_never_escape_the_roots(tree: tuple[Path, Path], prefix: str, parts: list[str]) -> None:
    root, outside = tree
    ref = (prefix + "/".join(parts)).replace("ROOT", str(root)).replace("OUTSIDE", str(outside))
    try:
        resolved = resolve_under_roots(ref, [root], what="image", roots_key="image_roots")
    except PathRefused:
        pass
    else:
        assert _is_under(resolved, root), (ref, resolved)
    try:
        image = load_image(ref, [root])
    except PathRefused:
        return
    assert image.mode == "RGB" and image.size == (4, 3), ref  # only root/a.png, sub/b.png, inner.png


B64 = st.binary(max_size=120).map(lambda b: base64.b64encode(b).decode())
DATA_URLS = st.one_of(
    st.builds(
        lambda m, p: f"data:{m};base64,{p}", st.sampled_from(["image/png", "image/x", "", "text/html"]), B64
    ),
    st.builds(lambda p: "data:image/png;base64," + p, st.text(max_size=40)),
    st.text(max_size=60).map(lambda t: "data:" + t),
    st.builds(
        lambda d: "data:image/png;base64," + base64.b64encode(d).decode(),
        st.binary(max_size=40).map(lambda b: _png()[:20] + b),
    ),
)


@SETTINGS
@given(url=DATA_URLS)
def test_data_urls_decode_or_are_refused(url: str) -> None:
    try:
        image = load_image(url, [])
    except PathRefused:
        return
    assert image.mode == "RGB"


def _png_claiming(width: int, height: int) -> bytes:
    """A tiny valid-looking PNG whose header claims `width x height` (nothing that large is encoded)."""
    png = bytearray(_png(1, 1))
    ihdr = png[12:29]  # b"IHDR" + 13 bytes of header data
    ihdr[4:12] = struct.pack(">II", width, height)
    png[12:29] = ihdr
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(png)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # pillow warns, we refuse
@pytest.mark.parametrize("side", [9_500, 12_000, 20_000])  # 90 Mpx (warn zone), 144 Mpx, 400 Mpx
def test_decompression_bombs_are_refused_before_decoding(tmp_path: Path, side: int) -> None:
    assert side * side > MAX_IMAGE_PIXELS
    bomb = _png_claiming(side, side)
    (tmp_path / "bomb.png").write_bytes(bomb)
    url = "data:image/png;base64," + base64.b64encode(bomb).decode()
    for ref, roots in ((url, []), (str(tmp_path / "bomb.png"), [tmp_path])):
        with pytest.raises(PathRefused, match="pixels"):
            load_image(ref, roots)


def test_a_symlinked_root_is_fine_but_links_out_of_it_are_not(
    tree: tuple[Path, Path], tmp_path: Path
) -> None:
    root, _ = tree
    alias = tmp_path / "alias"
    alias.symlink_to(root, target_is_directory=True)
    assert load_image(str(alias / "a.png"), [alias]).size == (4, 3)
    for ref in ("out.png", "outdir/secret.png"):
        with pytest.raises(PathRefused, match="resolves outside"):
            load_image(str(alias / ref), [alias])
