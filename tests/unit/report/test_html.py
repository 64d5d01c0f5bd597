"""report.html: written beside report.md for a train-ab run, an eval dir, a Stage-B mission and a comparison;
it shows the summary, the plots, the galleries and (Stage-B) the guidance versions, and names only files that
exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stagectl.report.html import Figure, Page, comparison_page, page_links, write_html
from stagectl.report.write import write_reports
from tests.helpers import write_report_dirs


def links_exist(page: Path) -> list[str]:
    links = page_links(page.read_text())
    missing = [link for link in links if not (page.parent / link).is_file()]
    assert not missing, f"{page} links missing files: {missing}"
    return links


def test_run_page_has_summary_plots_both_galleries_and_phase_times(tmp_path: Path) -> None:
    run, _, _ = write_report_dirs(tmp_path)
    (written,) = write_reports(run)
    assert written.html == run / "report.html"
    html = written.html.read_text()
    links = links_exist(written.html)
    assert any(link.startswith("eval/gallery/") for link in links)  # the held-out eval gallery
    assert "b_gallery/step000003_sample00000.png" in links  # the Channel-B gallery
    assert (
        sum(link.startswith("report/") and link.endswith(".png") for link in links) == written.num_plots > 0
    )
    assert "Channel-A / Channel-B steps" in html and "Time per phase" in html and "forward_backward" in html
    assert re.search(r'<span class="geo"[^>]*>&lt;\|coord_125\|&gt;</span>', html)  # geometry token marked
    assert "blue square" in html and "matched" in html  # the appended miss, the verdict
    assert "http://" not in html and "https://" not in html  # nothing fetched at view time


def test_eval_page_shows_the_gallery(tmp_path: Path) -> None:
    _, ev, _ = write_report_dirs(tmp_path)
    (written,) = write_reports(ev)
    links = links_exist(written.html or Path("-"))
    assert [link for link in links if link.startswith("gallery/")] == [
        "gallery/000_scene.png",
        "gallery/001_scene.png",
    ]
    index = ev / "gallery" / "index.html"
    assert page_links(index.read_text()) and all(
        (index.parent / link).is_file() for link in page_links(index.read_text())
    )


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"images": [{"file": "000_scene.png", "ti', "JSONDecodeError"),  # torn
        ('{"images": [{"file": "000_scene.png"}]}', "KeyError: 'index'"),  # not ours
        ("[1, 2]", "AttributeError"),
    ],
)
def test_a_broken_gallery_listing_is_an_error_naming_it(tmp_path: Path, text: str, why: str) -> None:
    """A torn or foreign `gallery/gallery.json` was a bare JSON error (no file named) or a KeyError traceback."""
    _, ev, _ = write_report_dirs(tmp_path)
    listing = ev / "gallery" / "gallery.json"
    listing.write_text(text)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(listing))}: not a gallery .*{re.escape(why)}"):
        write_reports(ev)


def test_stage_b_page_shows_accuracy_and_each_guidance_version_with_its_reflection(tmp_path: Path) -> None:
    _, _, mission = write_report_dirs(tmp_path)
    (written,) = write_reports(mission)
    html = (written.html or Path("-")).read_text()
    links_exist(mission / "report.html")
    assert (
        "guidance step 0 → 1" in html and "a scratch is a fail" in html and "add G1: scratches fail" in html
    )
    assert any("accuracy" in link for link in page_links(html))


def test_a_page_naming_a_missing_file_is_refused(tmp_path: Path) -> None:
    page = Page("t", "s", figures=[Figure("report/nothing.png", "gone")])
    with pytest.raises(ValueError, match=r"report/nothing\.png"):
        write_html(tmp_path, page)
    assert not (tmp_path / "report.html").exists()


def test_comparison_page_links_each_runs_gallery_relative_to_itself(tmp_path: Path) -> None:
    run, _, _ = write_report_dirs(tmp_path)
    out = tmp_path / "cmp"
    out.mkdir()
    plot = out / "comparison_f1.png"
    plot.write_bytes((run / "b_gallery" / "step000003_sample00000.png").read_bytes())
    table = ["| variant | seeds |", "|---|---|", "| A-only | 2 |"]
    page = write_html(out, comparison_page(out, "intro", table, plot, [run]), "comparison.html")
    links = links_exist(page)
    assert "<td>A-only</td>" in page.read_text()
    assert [link for link in links if "gallery" in link] == [
        "../run/eval/gallery/000_scene.png",
        "../run/eval/gallery/001_scene.png",
    ]
