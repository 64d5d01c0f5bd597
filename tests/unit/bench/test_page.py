"""BENCHMARKS.md against bench/results/: the committed page is what `bench.document` renders from the
committed results (a hand edit or a stale section shows here), and the recorded separated check reads
as its runs were configured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import document
from bench.markdown_learning import AB, separated_section


def test_benchmarks_md_is_what_the_generator_renders_from_bench_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plots = document.ROOT / "bench" / "plots"

    def committed_plot(name: str, result: dict[str, Any]) -> str | None:
        """The page links the committed PNG; drawing it again is the plot code's business, not the text's."""
        return f"bench/plots/{name}.png" if (plots / f"{name}.png").is_file() else None

    monkeypatch.setattr(document, "ROOT", tmp_path)
    monkeypatch.setattr(document, "plot", committed_plot)
    document.write_markdown()

    rendered = (tmp_path / "BENCHMARKS.md").read_text().splitlines()
    committed = (Path(__file__).parents[3] / "BENCHMARKS.md").read_text().splitlines()
    assert len(rendered) > 100 and "## Learning check (A-only vs AB)" in rendered  # the page was rendered
    # the first differing line, not a 600-line diff
    first = next((k for k, (a, b) in enumerate(zip(rendered, committed, strict=False)) if a != b), None)
    assert first is None, (
        f"BENCHMARKS.md line {first + 1}: {committed[first]!r}, rendered {rendered[first]!r}"
    )
    assert len(rendered) == len(committed)


def test_the_recorded_separated_check_shows_the_arm_b_ratio_and_intervals() -> None:
    """The AB rows of the headline tables carry the b_ratio the runs trained with (the record holds 0 there:
    the arm's b_ratio was not carried into them), and the reading gives AB's lead with its interval."""
    r = json.loads((document.RESULTS / "learning.json").read_text())["result"]
    arm = r["separated"]["arm"]["b_ratio"]
    assert arm > 0
    lines = separated_section(r)
    headline_ab = [line for line in lines if line.startswith(f"| {AB} | ") and line.count("|") == 14]
    assert len(headline_ab) == 2 * len(r["separated"]["tasks"])  # equal time and equal steps, per task
    assert {line.split(" | ")[1] for line in headline_ab} == {f"{arm:g}"}
    for t in r["separated"]["tasks"].values():
        d = t["f1"]["delta_equal_steps"]
        assert f"(measured {d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}])" in "\n".join(lines)


def test_bench_help_lists_every_benchmark_the_page_has(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m bench --help` names each benchmark once, the ones BENCHMARKS.md has sections for, and no
    stray empty choice."""
    from bench.__main__ import main

    monkeypatch.setattr("sys.argv", ["python -m bench", "--help"])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert "usage: python -m bench" in text
    assert f"benchmarks to run (default: all): {', '.join(document.MODULES)}" in text
    assert "[]" not in text and ",}" not in text
    assert set(document.TITLES) == set(document.MODULES)  # a section title for every benchmark


def test_docs_quote_the_recorded_benchmarks() -> None:
    """Figures the docs cite from BENCHMARKS.md are the recorded ones: the in-flight vs fenced medians over
    the async section's 4 pairs (docs/training.md) and the sparse Stage-1 row (docs/evaluation.md)."""
    import re
    from statistics import median

    docs = Path(__file__).parents[3] / "docs"
    a = json.loads((document.RESULTS / "async.json").read_text())["result"]
    pairs = {
        name: [a["compare"][f"{name}/separated"], *a["repeats"]["runs"][name]]
        for name in ("example", "example-fenced")
    }
    fenced_idle = [a["runs"]["example-fenced/async/separated"]["learner_idle_fraction"]] + [
        x["idle"] for x in a["repeats"]["runs"]["example-fenced"]
    ]
    speedup = {name: median(x["async_over_step"] for x in rows) for name, rows in pairs.items()}
    training = " ".join((docs / "training.md").read_text().split())
    assert (
        f"against a median {median(fenced_idle):.3f} fenced" in training
        and f"(median {speedup['example']:.2f}x against {speedup['example-fenced']:.2f}x;" in training
    )
    stage1 = json.loads((document.RESULTS / "learning.json").read_text())["result"]["tasks"]["sparse"][
        "stage1"
    ]
    evaluation = " ".join((docs / "evaluation.md").read_text().split())
    quoted = re.search(
        r"against ([\d.]+) by `coord_desc` / ([\d.]+) in BENCHMARKS.md's sparse Stage-1 row", evaluation
    )
    assert quoted is not None
    assert quoted.groups() == (
        f"{stage1['metrics']['AP']['value']:.3f}",
        f"{stage1['metrics']['f1']['value']:.3f}",
    )


def test_the_screen_ranking_says_it_is_read_at_equal_steps() -> None:
    """The confirmation's two variants are the best mean ΔAP at equal steps (`bench_learning.best_two`):
    the page says which read it ranks, and its figures are those means."""
    from statistics import mean

    from bench.markdown_learning import learning_section

    r = json.loads((document.RESULTS / "learning.json").read_text())["result"]
    text = "\n".join(learning_section(r))
    at_steps: dict[str, list[float]] = {}
    for t in r["tasks"].values():
        for row in t.get("screen", []):
            at_steps.setdefault(row["variant"], []).append(row["metrics"]["d_AP"]["value"])
    ranked = sorted(at_steps, key=lambda v: -mean(at_steps[v]))
    assert "the best mean class-aware ΔAP in the screen (equal steps)" in text
    assert (
        "Screen, mean class-aware ΔAP vs A-only at equal steps over the tasks (seed 0): "
        + ", ".join(f"{v} {mean(at_steps[v]):+.3f}" for v in ranked)
        in text
    )
    assert r["selection"]["best_two"] == ranked[:2]


def test_every_section_names_the_command_that_produced_it() -> None:
    """Under each benchmark's heading, its `_Ran ..._` line gives the command that re-runs it, one the
    bench's entry point accepts; the separated sub-section gives its own."""
    from bench.__main__ import main

    assert main  # the entry point the commands name
    page = (Path(__file__).parents[3] / "BENCHMARKS.md").read_text().splitlines()
    for name, title in document.TITLES.items():
        at = page.index(f"## {title}")
        ran = next(line for line in page[at + 1 :] if line.startswith("_Ran ") or line.startswith("Not run"))
        assert f"`python -m bench {name}`" in ran, (name, ran)
    separated = next(line for line in page if line.startswith("_Ran ") and "its runs" in line)
    assert "`python -m bench.bench_learning --separated-only --out DIR`" in separated


def test_the_protocol_rows_are_read_as_seed_0() -> None:
    """The protocol bullets (A-only against the Stage-1 checkpoint) are seed 0's, as their table rows say
    (seeds 1); the 3-seed A-only row is the confirmation table's, with another interval."""
    from bench.markdown_learning import task_reading

    r = json.loads((document.RESULTS / "learning.json").read_text())["result"]
    for task, t in r["tasks"].items():
        for p, line in zip(t["protocol"], task_reading(task, t), strict=False):
            assert p["seeds"] == 1 and f"at step {t['step']}, seed 0, against the Stage-1 checkpoint" in line


def test_the_memory_section_reads_fsdp_speed_as_measured() -> None:
    """The recorded fsdp x2 ranks ran faster than ddp x2's (733-734 against 410-443 tokens/s): the section
    no longer says fsdp's collectives cost time here, it gives both as measured."""
    from bench.markdown_memory import memory

    r = json.loads((document.RESULTS / "memory.json").read_text())["result"]
    speeds = {
        run["parallelism"]: [k["tokens_per_s"] for k in run["ranks"]]
        for run in r["runs"]
        if run["world_size"] == 2 and not run["gradient_checkpointing"]
    }
    text = "\n".join(memory(r))
    assert "cost time here" not in text
    fsdp, ddp = speeds["fsdp"], speeds["ddp"]
    assert (
        f"fsdp x2 read {min(fsdp):.0f}-{max(fsdp):.0f} against ddp x2's {min(ddp):.0f}-{max(ddp):.0f}" in text
    )
