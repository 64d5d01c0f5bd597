"""The report pages in a real browser (headless Chromium, Debian's `chromium`; `make chromium` installs it):
a tiny train-ab run's report.html and an eval dir's render with every image decoded, no console error or
failed load, and a screenshot that is not blank. Skipped, with the reason, where Chromium is absent."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from stagectl.report.write import write_reports
from tests.browser.chromium import find_chromium, load_page
from tests.helpers import write_report_dirs

CHROMIUM = find_chromium()

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="chromium not installed (Debian: apt-get install -y chromium; `make chromium`)",
    ),
]


@pytest.fixture(scope="module")
def report_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    run, ev, _ = write_report_dirs(tmp_path_factory.mktemp("report_page"))
    return run, ev


def non_background_share(png: bytes) -> float:
    """The share of pixels that differ from the most common colour (the page background)."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    colours = image.getcolors(maxcolors=image.width * image.height) or []
    return 1.0 - max(count for count, _ in colours) / (image.width * image.height)


@pytest.mark.parametrize("which", ["run", "eval"])
def test_report_page_renders_in_chromium(report_dirs: tuple[Path, Path], which: str, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    run_or_eval = report_dirs[0] if which == "run" else report_dirs[1]
    (written,) = write_reports(run_or_eval)
    assert written.html is not None
    page = load_page(CHROMIUM, written.html)
    (tmp_path / "screenshot.png").write_bytes(page.screenshot_png)
    assert page.errors == []
    assert page.broken_images == []
    assert page.num_images >= (5 if which == "run" else 3)  # plots + the gallery images (+ the B record's)
    assert non_background_share(page.screenshot_png) > 0.02, "the screenshot is blank"
