"""report.html beside report.md (jinja2, `stagectl/templates/report.html.j2`): the same summary, every plot, the
galleries a run dir holds (the held-out eval's `eval/gallery/`, the Channel-B `b_gallery/`), the learner's
time per phase, and for Stage-B the guidance versions with the reflections that changed them.

The page is built from the data the markdown report is built from (`TrainAbSummary`, `Figures`, ...), and
links only files under the page's own directory by relative paths (no server, no network). `page_links`
lists them, so tests check each exists.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagectl.files import atomic_write_text
from stagectl.report.sections import Figures
from stagectl.report.values import Row, number
from stagectl.templating import render
from stagectl.timing import PHASES, phase_key

REPORT_HTML = "report.html"
EVAL_GALLERY = Path("gallery") / "gallery.json"  # under a `stagectl eval` dir
RUN_EVAL_DIR = "eval"  # `stagectl eval`'s default --out under a run dir
B_RECORDS = Path("b_gallery") / "records.jsonl"
# the page shows at most this many Channel-B records, evenly spaced over the run (the first and the last
# among them): a record holds every target token, so a run with many would make a page of many megabytes
MAX_B_RECORDS_SHOWN = 32


@dataclass(frozen=True)
class Figure:
    src: str  # relative to the page
    title: str
    caption: str = ""
    # a gallery image's boxes as text ({what, colour, label}): the PNG's captions draw ASCII only
    boxes: list[dict[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Grid:
    title: str
    header: Sequence[str]
    rows: Sequence[Sequence[str]]


@dataclass(frozen=True)
class Gallery:
    title: str
    intro: str
    items: list[Figure]
    legend: list[dict[str, str]]
    notes: list[str] = field(default_factory=list)  # what it left out (a listed image that is not there)


@dataclass
class Page:
    title: str
    subtitle: str
    summary: list[tuple[str, str]] = field(default_factory=list)
    grids: list[Grid] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    galleries: list[Gallery] = field(default_factory=list)
    b_records: list[dict[str, Any]] = field(default_factory=list)
    guidance_versions: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def page_from_figures(
    title: str, subtitle: str, figures: Figures, plot_dir: str, notes: Sequence[str] = ()
) -> Page:
    """A page with the report's plots (linked under `plot_dir`) and what was not plotted."""
    return Page(
        title,
        subtitle,
        figures=[Figure(f"{plot_dir}/{p.file}", p.title, p.caption) for p in figures.plots],
        skipped=[f"{s.what}: {s.reason}" for s in figures.skipped],
        notes=list(notes),
    )


def phase_grid(rows: Sequence[Row]) -> Grid | None:
    """Summed learner time per phase (`time/<phase>_s`) and its share of the summed step time."""
    total = sum(number(r, "time/step_s") or 0.0 for r in rows)
    sums = {phase: sum(number(r, phase_key(phase)) or 0.0 for r in rows) for phase in PHASES}
    if total <= 0 or not any(sums.values()):
        return None
    out = [[phase, f"{s:.2f}", f"{100 * s / total:.1f}%"] for phase, s in sums.items()]
    out.append(["(all steps)", f"{total:.2f}", "100%"])
    return Grid("Time per phase (rank 0)", ("phase", "seconds", "share of step time"), out)


def eval_gallery(page_dir: Path, eval_dir: Path, title: str) -> Gallery | None:
    """The gallery `stagectl eval` wrote under `eval_dir`, its images linked relative to `page_dir`."""
    from stagectl.evaluation.gallery import box_rows, gallery_intro, legend

    listing = eval_dir / EVAL_GALLERY
    if not listing.is_file():
        return None
    base = Path(os.path.relpath(listing.parent.resolve(), page_dir.resolve())).as_posix()
    try:
        saved = json.loads(listing.read_text(encoding="utf-8"))
        entries = saved.get("images", [])
        missing = [str(e["file"]) for e in entries if not (listing.parent / e["file"]).is_file()]
        items = [
            Figure(
                f"{base}/{e['file']}",
                e.get("title", f"image {e['index']}"),  # a gallery written before titles: its position
                f"{e['num_missed']} missed, {e['num_fp']} false positive(s) of {e['num_gt']} GT / {e['num_pred']} predicted",
                box_rows(e.get("boxes", [])),
            )
            for e in entries
            if str(e["file"]) not in missing
        ]
        intro = (
            gallery_intro(len(entries), saved["num_evaluated"], saved["num_imperfect"])
            if "num_imperfect" in saved
            else f"The {len(entries)} worst images (most misses + false positives first)."
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(
            f"{listing}: not a gallery as `stagectl eval` writes it ({type(exc).__name__}: {exc}); draw it "
            f"again with `stagectl eval ... --overwrite`, or remove {listing.parent} to report without it"
        ) from None
    intro += f" The full gallery: {base}/index.html."
    notes = [
        f"{title}: {len(missing)} image(s) `{listing.name}` lists are not in {listing.parent} (not shown: "
        f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}); draw them again with `stagectl eval "
        "... --overwrite`."
    ]
    return Gallery(title, intro, items, legend() if items else [], notes if missing else [])


def b_records(run_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The Channel-B gallery records of a run (`b_gallery/records.jsonl`), ready for the template, and notes
    on what was left out (an unreadable line, such as a crash's torn last line; a record whose PNG is not
    there). ValueError naming the file and line for a record that is not one train-ab writes."""
    from stagectl.report.jsonl import JsonlRows

    path = run_dir / B_RECORDS
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else []
    out: list[dict[str, Any]] = []
    missing: list[str] = []
    unreadable: list[int] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            unreadable.append(line_no)
            continue
        try:
            if not (path.parent / str(record["image"])).is_file():
                missing.append(f"step {record['step']} ({record['image']})")
                continue
            record["src"] = f"{B_RECORDS.parent.as_posix()}/{record['image']}"
            record.setdefault("stop_reason", "")
            record.setdefault("gen_version", None)  # records written before it: not known
            record["tokens"] = token_runs(record["tokens"])
            for o in record["objects"]:
                o["iou"] = "" if o["iou"] is None else f"{o['iou']:.3f}"
            record["misses"] = [m["desc"] for m in record["misses"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{path}: line {line_no} is not a Channel-B gallery record as train-ab writes it "
                f"({type(exc).__name__}: {exc}); remove {path.parent} to report without it"
            ) from None
        out.append(record)
    notes = JsonlRows(path, bad_lines=unreadable, num_lines=len(lines)).notes()
    if len(out) > MAX_B_RECORDS_SHOWN:
        notes.append(
            f"Channel-B gallery: the page shows {MAX_B_RECORDS_SHOWN} of the {len(out)} records, evenly spaced "
            f"over the run (every record: `{B_RECORDS.as_posix()}`)."
        )
        last = len(out) - 1
        out = [out[round(k * last / (MAX_B_RECORDS_SHOWN - 1))] for k in range(MAX_B_RECORDS_SHOWN)]
    if missing:
        notes.append(
            f"Channel-B gallery: {len(missing)} record(s) of `{path.name}` without their image in "
            f"{path.parent} (not shown): {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}."
        )
    return out, notes


def token_runs(tokens: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A record's target tokens as runs of neighbours with the same loss (one `<span>` each on the page, not
    one per token): `{text, ce, cls}` with `cls` geo (geometry loss), ce (CE only) or ce0 (no loss)."""
    runs: list[dict[str, Any]] = []
    for t in tokens:
        cls = "geo" if t["geo"] else ("ce" if t["ce"] > 0 else "ce0")
        if runs and runs[-1]["cls"] == cls and runs[-1]["ce"] == t["ce"]:
            runs[-1]["text"] += t["text"]
        else:
            runs.append({"text": str(t["text"]), "ce": t["ce"], "cls": cls})
    return runs


def guidance_versions(mission_dir: Path, reflections: Sequence[Row]) -> list[dict[str, Any]]:
    """Each reflection that changed the guidance: the steps, its accepted operations, the rules of the
    version it made (from `snapshots/`, when kept) and the reflection's answer."""
    out = []
    for row in reflections:
        if not row.get("changed"):
            continue
        after = row.get("guidance_step_after")
        rules: list[tuple[str, str]] = []
        if isinstance(after, int):
            for snap in sorted((mission_dir / "snapshots").glob(f"*step{after:06d}.json")):
                data = json.loads(snap.read_text(encoding="utf-8"))
                rules = [(str(k), str(v)) for k, v in (data.get("experiences") or {}).items()]
        ops = [
            ", ".join(f"{k}={v}" for k, v in op.items() if v not in (None, ""))
            for op in row.get("accepted", [])
        ]
        out.append(
            {
                "step_before": row.get("guidance_step_before"),
                "step_after": after,
                "ops": ops,
                "rules": rules,
                "reflection": str(row.get("answer") or ""),
            }
        )
    return out


def write_html(page_dir: Path, page: Page, name: str = REPORT_HTML) -> Path:
    """`page_dir/<name>`; ValueError when the page would link a file that is not there."""
    from stagectl.evaluation.gallery import legend

    text = render("report.html.j2", page=page, title=page.title, b_legend=legend())
    missing = [link for link in page_links(text) if not (page_dir / link).is_file()]
    if missing:
        raise ValueError(f"report.html would link missing files under {page_dir}: {', '.join(missing[:5])}")
    path = page_dir / name
    atomic_write_text(path, text)  # an earlier page stays whole until this one is
    return path


_LINK = re.compile(r'(?:src|href)="([^"#:]+)"')


def page_links(html: str) -> list[str]:
    """Every relative file an HTML page links (src= and href=, no data: or other schemes)."""
    return _LINK.findall(html)


def train_ab_page(
    run_dir: Path,
    title: str,
    subtitle: str,
    summary_rows: list[tuple[str, str]],
    terms: Sequence[Any],
    rows: Sequence[Row],
    figures: Figures,
    plot_dir: str,
    notes: Sequence[str],
) -> Page:
    """A train-ab run's page: the report.md summary and loss terms, time per phase, every plot, the
    held-out eval gallery (`RUN_DIR/eval/`, where `stagectl eval` writes by default) and the Channel-B gallery."""
    page = page_from_figures(title, subtitle, figures, plot_dir, notes)
    page.summary = summary_rows
    page.grids.append(
        Grid(
            "Loss per term",
            ("term", "first", "last", "min"),
            [
                [
                    t.term,
                    f"{t.first:.4g} (step {t.first_step})",
                    f"{t.last:.4g} (step {t.last_step})",
                    f"{t.min:.4g}",
                ]
                for t in terms
            ],
        )
    )
    phases = phase_grid(rows)
    if phases is not None:
        page.grids.append(phases)
    gallery = eval_gallery(run_dir, run_dir / RUN_EVAL_DIR, "Held-out eval gallery")
    if gallery is not None:
        page.galleries.append(gallery)
        page.notes += gallery.notes
    page.b_records, b_notes = b_records(run_dir)
    page.notes += b_notes
    return page


def eval_page(
    eval_dir: Path,
    title: str,
    subtitle: str,
    summary_rows: list[tuple[str, str]],
    per_class: Grid,
    figures: Figures,
    plot_dir: str,
    notes: Sequence[str] = (),
) -> Page:
    """A `stagectl eval` dir's page: the metrics, AP per class, the PR curve and the gallery."""
    page = page_from_figures(title, subtitle, figures, plot_dir, notes)
    page.summary = summary_rows
    page.grids.append(per_class)
    gallery = eval_gallery(eval_dir, eval_dir, "Prediction gallery")
    if gallery is not None:
        page.galleries.append(gallery)
        page.notes += gallery.notes
    return page


def comparison_page(
    out_dir: Path, intro: str, table: Sequence[str], plot: Path, run_dirs: Sequence[Path]
) -> Page:
    """A comparison's page: the comparison table (report.md's rows), the F1 plot and each run's held-out
    eval gallery when it has one (linked relative to `out_dir`)."""
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table]
    page = Page("Run comparison", intro, figures=[Figure(plot.name, "held-out F1")])
    if len(cells) >= 2:
        page.grids.append(Grid("Held-out eval by variant", cells[0], cells[2:]))
    for run_dir in run_dirs:
        gallery = eval_gallery(out_dir, run_dir / RUN_EVAL_DIR, f"Held-out eval gallery of {run_dir}")
        if gallery is not None:
            page.galleries.append(gallery)
            page.notes += gallery.notes
    return page
