"""Where the server may read files: request images under `image_roots`, weight snapshots under the
weight directories. Inline `data:image/...;base64,` images are decoded here too.

A path is refused before anything is read when it is a URL, contains `..`, or resolves (symlinks
followed) outside every allowed root, so a symlink inside a root cannot point out of it. An image
whose header claims more than `MAX_IMAGE_PIXELS` (pillow's own decompression-bomb threshold) is
refused before its pixels are decoded: a small PNG can claim 100M pixels (300 MB once decoded).
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from PIL import Image, UnidentifiedImageError

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+)?(;[^,;]+=[^,;]*)*;base64,", re.ASCII)
MAX_IMAGE_PIXELS = int(Image.MAX_IMAGE_PIXELS or 89_478_485)
# Qwen-VL image processors (transformers' `smart_resize`, vLLM's too) refuse a longer side above 200x the
# shorter. Checked here, per request: inside vLLM's batched generate the refusal failed every call that shared
# the batch, each answered 400 naming another caller's image.
MAX_ASPECT_RATIO = 200


class PathRefused(ValueError):
    """A request named a file the server must not read (HTTP 400)."""


def resolve_under_roots(raw: str, roots: Sequence[Path], *, what: str, roots_key: str) -> Path:
    """The resolved path of `raw` if it lies under one of `roots`; `PathRefused` otherwise."""
    if _SCHEME.match(raw):
        raise PathRefused(f"{what} {raw[:80]!r}: URLs are not fetched; send a path or an inline data: URL")
    if "\0" in raw:
        raise PathRefused(f"{what} {raw[:80]!r}: NUL characters are not allowed in paths")
    path = Path(raw).expanduser()
    if ".." in path.parts:
        raise PathRefused(f"{what} {raw!r}: '..' is not allowed in paths")
    if not roots:
        raise PathRefused(f"{what} {raw!r}: the server allows no {what} paths ({roots_key} is empty)")
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise PathRefused(f"{what} {raw!r}: cannot be resolved ({exc})") from None
    for root in roots:
        if resolved.is_relative_to(root.expanduser().resolve()):
            return resolved
    allowed = ", ".join(str(r) for r in roots)
    raise PathRefused(f"{what} {raw!r} resolves outside {roots_key} ({allowed})")


def decode_data_url(url: str) -> Image.Image:
    """An inline `data:image/...;base64,...` image as RGB."""
    match = _DATA_URL.match(url)
    if match is None:
        raise PathRefused("inline images must be base64 data URLs: data:image/png;base64,...")
    try:
        raw = base64.b64decode(url[match.end() :], validate=True)
    except ValueError as exc:  # binascii.Error, or characters outside ASCII
        raise PathRefused(f"inline image: invalid base64 ({exc})") from None
    return _decode(io.BytesIO(raw), "inline image")


def load_image(ref: str, roots: Sequence[Path]) -> Image.Image:
    """A request image (path under `roots` or data URL) as RGB; `PathRefused` for anything else."""
    if ref.startswith("data:"):
        return decode_data_url(ref)
    path = resolve_under_roots(ref, roots, what="image", roots_key="rollout_server.image_roots")
    try:
        if not path.is_file():
            raise PathRefused(f"image {ref!r}: no such file")
        with path.open("rb") as handle:
            return _decode(handle, f"image {ref!r}")
    except PathRefused:
        raise
    except OSError as exc:  # a name too long, no permission, an I/O error: a 500 and a traceback before
        raise PathRefused(f"image {ref[:200]!r}: cannot be read ({exc.strerror or exc})") from None


def _decode(handle: BinaryIO, what: str) -> Image.Image:
    try:
        with Image.open(handle) as image:
            if image.width * image.height > MAX_IMAGE_PIXELS:  # header only so far: nothing decoded
                raise PathRefused(
                    f"{what}: {image.width}x{image.height} is more than {MAX_IMAGE_PIXELS} pixels"
                )
            if max(image.size) > MAX_ASPECT_RATIO * min(image.size):
                raise PathRefused(
                    f"{what}: {image.width}x{image.height} is more than {MAX_ASPECT_RATIO} times as long as it "
                    "is wide (the Qwen-VL image processors' limit); crop or pad it"
                )
            return image.convert("RGB")
    except UnidentifiedImageError:  # PIL's message names the handle object (a memory address), not the data
        raise PathRefused(f"{what}: not a readable image (no image format recognised)") from None
    except (OSError, Image.DecompressionBombError) as exc:
        raise PathRefused(f"{what}: not a readable image ({exc})") from None
