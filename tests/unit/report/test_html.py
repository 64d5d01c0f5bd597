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


def test_a_gallery_image_that_is_not_there_is_named_in_a_note(tmp_path: Path) -> None:
    """A listed eval-gallery PNG or a Channel-B record's PNG that was gone was left out without a word (and
    the intro counted one image fewer as drawn)."""
    run, ev, _ = write_report_dirs(tmp_path)
    (ev / "gallery" / "001_scene.png").unlink()
    (run / "b_gallery" / "step000003_sample00000.png").unlink()
    (written,) = write_reports(run)
    html = (written.html or Path("-")).read_text()
    links_exist(run / "report.html")
    assert "2 of 2 evaluated images have a miss or a false positive (all drawn" in html
    gallery_note, b_note = [n for n in written.notes if "gallery" in n.lower()]
    assert "001_scene.png" in gallery_note and str(ev / "gallery") in gallery_note
    assert "step 3 (step000003_sample00000.png)" in b_note
    assert "001_scene.png" in html and "step000003_sample00000.png" in html  # on the page too


def test_a_torn_channel_b_record_is_skipped_and_noted_a_foreign_one_named(tmp_path: Path) -> None:
    """A crash's torn last line of `b_gallery/records.jsonl` failed the whole report with a bare JSON error
    (`Unterminated string ...`, no file named); a line that is not a record was a KeyError."""
    run, _, _ = write_report_dirs(tmp_path)
    records = run / "b_gallery" / "records.jsonl"
    whole = records.read_text()
    records.write_text(whole + whole[:40])
    (written,) = write_reports(run)
    assert "b_gallery/step000003_sample00000.png" in page_links((written.html or Path("-")).read_text())
    assert any(
        n.startswith("`records.jsonl`: skipped 1 unreadable line(s): 2 (a torn last line")
        for n in written.notes
    )
    records.write_text(whole + '{"image": "step000003_sample00000.png"}\n')
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(records))}: line 2 is not a Channel-B gallery record"
    ):
        write_reports(run)


def test_labels_are_escaped_shown_as_text_in_any_script_and_the_policy_version_is_named(
    tmp_path: Path,
) -> None:
    """The PNG captions draw ASCII only (a non-ASCII desc was a row of boxes), and the eval gallery's page
    listed no label; a Channel-B record did not say which policy version its rollout came from."""
    from dataclasses import replace

    from stagectl.data.sample import DetectionSample, DetObject
    from stagectl.detection.stats import RolloutStats
    from stagectl.evaluation.core import ImageOutcome
    from stagectl.evaluation.gallery import write_gallery
    from stagectl.learner.channel_b.gallery import BRecord, ObjectVerdict, write_record

    run, ev, _ = write_report_dirs(tmp_path)
    image = str(tmp_path / "scene.png")
    tricky, cjk = "<b>&\"'", "Straßenbahn 電車"
    sample = DetectionSample([image], 320, 240, [DetObject(tricky, (125, 125, 467, 543))])
    parsed = [{"desc": cjk, "bbox_2d": [10, 700, 200, 950], "score": 0.4}]
    write_gallery(
        ev / "gallery",
        [sample],
        [ImageOutcome(0, RolloutStats(), [], 0, parsed)],
        num_images=2,
        duplicate_iou_threshold=0.7,
    )
    (run / "b_gallery" / "records.jsonl").unlink()
    record = BRecord(
        5,
        0,
        "clean_prefix",
        "{",
        [ObjectVerdict("object_1", cjk, "false_positive", None, [1, 2, 3, 4])],
        [{"gt": 0, "desc": tricky}],
        [],
        gen_version=4,
    )
    write_record(run / "b_gallery", record, sample)
    write_record(
        run / "b_gallery", replace(record, step=6, gen_version=None), sample
    )  # a record from before versions
    for page in (write_reports(run)[0].html or Path("-"), ev / "gallery" / "index.html"):
        html = page.read_text(encoding="utf-8")
        assert tricky not in html and "<b>&" not in html
        assert "GT &lt;b&gt;&amp;&#34;&#39;" in html  # the GT caption, escaped
        assert f"{cjk} 0.40" in html  # the prediction's caption as text
    html = (run / "report.html").read_text(encoding="utf-8")
    assert "step 5, sample 0 (rollout of policy version 4; target clean_prefix" in html
    assert "step 6, sample 0 (target clean_prefix" in html
    assert f"<td>{cjk}</td>" in html and "Appended misses: &lt;b&gt;&amp;&#34;&#39;" in html


def test_the_page_stays_small_with_many_channel_b_records_and_boxes(tmp_path: Path) -> None:
    """Every record (each with every target token, one `<span>` per token) went on the page: 400 records of
    2,000 tokens made a page of tens of megabytes. It shows 32 evenly spaced ones, one span per run of tokens
    with the same loss, and lists at most 100 boxes of an image."""
    import json

    from stagectl.evaluation.gallery import MAX_LISTED_BOXES, box_rows

    run, _, _ = write_report_dirs(tmp_path)
    records = run / "b_gallery" / "records.jsonl"
    record = json.loads(records.read_text())
    record["tokens"] = [{"text": "ab", "ce": 1.0, "geo": False}] * 2000
    records.write_text("".join(json.dumps({**record, "step": 10 * k}) + "\n" for k in range(400)))
    (written,) = write_reports(run)
    html = (written.html or Path("-")).read_text()
    steps = [int(s) for s in re.findall(r"<h3>step (\d+), sample", html)]
    assert len(steps) == 32 and steps[0] == 0 and steps[-1] == 3990 and steps == sorted(set(steps))
    assert any("shows 32 of the 400 records" in n for n in written.notes)
    assert html.count('<span class="ce" title="CE 1.0">' + "ab" * 2000 + "</span>") == 32
    assert len(html) < 1_000_000
    boxes = [{"is_pred": True, "verdict": "false_positive", "label": f"p{k}"} for k in range(250)]
    rows = box_rows(boxes)
    assert len(rows) == MAX_LISTED_BOXES + 1 and rows[-1]["what"] == "... 150 more"
