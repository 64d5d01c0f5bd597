"""`stagectl stage-b` end to end: the real CLI in subprocesses, torchrun with 2 CPU ranks (gloo).

The semantics are checked with the deterministic test engine (`runner.engine: rules`); one run uses the
tiny HF model to show the model path works end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from itertools import accumulate
from pathlib import Path
from typing import Any

import pytest
import yaml

from stagectl.config.plan_stage_b import read_stage_b_plan
from tests.faults.helpers import INJECT_DIR
from tests.integration.helpers import (
    MISSION,
    REFLECTION_BATCH,
    ROOT,
    run_cli,
    stage_b_config,
    write_config,
)

ARTIFACTS = {
    "config.yaml",
    "plan.json",
    "progress.json",
    "guidance.json",
    "snapshots",
    "trajectories.jsonl",
    "selections.jsonl",
    "metrics.jsonl",
    "reflection.jsonl",
    "need_review_queue.jsonl",
    "failure_malformed.jsonl",
}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_stage_b(tmp: Path, *args: str, **sections: Any) -> tuple[subprocess.CompletedProcess[str], Path]:
    config = write_config(tmp / "cfg.yaml", stage_b_config(tmp, **sections))
    return run_cli("stage-b", str(config), *args, timeout=300), tmp / "out" / "r" / MISSION


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    result, run_dir = run_stage_b(tmp_path_factory.mktemp("two"), "--nproc", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return result, run_dir


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    # Same global batch (4 tickets) as two ranks x 2.
    result, run_dir = run_stage_b(
        tmp_path_factory.mktemp("one"), "--nproc", "1", runner={"per_rank_rollout_batch_size": 4}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result, run_dir


def test_relaunches_under_torchrun_and_only_rank_zero_writes(two_ranks: tuple) -> None:
    result, run_dir = two_ranks
    assert "launching: " in result.stderr and "--nproc-per-node=2" in result.stderr
    launching = next(line for line in result.stderr.splitlines() if line.startswith("launching: "))
    assert " --plan " in launching and " --set " not in launching  # the ranks read the plan, not the YAML
    assert {p.name for p in run_dir.iterdir()} == ARTIFACTS
    plan = read_stage_b_plan(run_dir / "plan.json")  # what the ranks ran, --nproc included
    assert plan.run_dir == run_dir and plan.resolved_config["launch"]["nproc_per_node"] == 2
    assert [p.name for p in run_dir.parents[1].iterdir()] == ["r"]  # nothing else under output.root
    trajectories = read_jsonl(run_dir / "trajectories.jsonl")
    selections = read_jsonl(run_dir / "selections.jsonl")
    # 16 tickets x 2 epochs, 4 candidates each, each written exactly once although both ranks judged.
    assert len(selections) == 32 and len(trajectories) == 128
    assert {r["rank"] for r in trajectories} == {0, 1}
    assert (
        len({(r["epoch"], r["ticket_key"], r["grid_index"], r["sample_index"]) for r in trajectories}) == 128
    )
    reflections = read_jsonl(run_dir / "reflection.jsonl")
    changes = sum(r["changed"] for r in reflections)
    assert len(list((run_dir / "snapshots").iterdir())) == 1 + changes  # the start + one per change


def test_bad_ticket_lines_reported_and_skipped(two_ranks: tuple) -> None:
    result, _ = two_ranks
    tickets = next(Path(p) for p in yaml.safe_load((two_ranks[1] / "config.yaml").read_text())["tickets"])
    assert f"{tickets}:4: not valid JSON" in result.stderr
    assert f"{tickets}:8: label must be 'pass' or 'fail'" in result.stderr
    assert result.stderr.count("stage-b: skipped ") == 2  # reported once, by rank 0
    # the run says it ran without them: its start and end lines and progress.json
    assert "16 tickets of qc (2 bad line(s) skipped: runner.bad_ticket_lines: skip)" in result.stderr
    assert f"warning: 2 bad ticket line(s) skipped (runner.bad_ticket_lines: skip), first: {tickets}:4" in (
        result.stderr
    )
    progress = json.loads((two_ranks[1] / "progress.json").read_text())
    assert progress["num_bad_ticket_lines"] == 2 and progress["bad_ticket_lines"][1].startswith(
        f"{tickets}:8: "
    )


def test_one_guidance_step_per_global_batch_and_updates_apply_from_the_next(two_ranks: tuple) -> None:
    _, run_dir = two_ranks
    trajectories = read_jsonl(run_dir / "trajectories.jsonl")
    steps_by_batch: dict[int, set[int]] = defaultdict(set)
    for row in trajectories:
        steps_by_batch[row["batch_index"]].add(row["guidance_step"])
    assert sorted(steps_by_batch) == list(range(8))  # 16 tickets / 4 per global batch x 2 epochs
    assert all(len(steps) == 1 for steps in steps_by_batch.values())
    reflections = read_jsonl(run_dir / "reflection.jsonl")
    accepted = [r for r in reflections if r["changed"]]
    assert accepted, "the data is built so that reflection adds a rule"
    assert accepted[0]["batch_index"] < 7
    for batch, steps in steps_by_batch.items():
        expected = sum(1 for r in accepted if r["batch_index"] < batch)  # start step is 0
        assert steps == {expected}, f"batch {batch}"
    final = json.loads((run_dir / "guidance.json").read_text())
    assert final["step"] == len(accepted)
    assert final["experiences"]["G0"] == "judge the group" and final["experiences"]["S1"]
    assert "red means fail" in final["experiences"].values()
    # Every reflection tried to delete G0 and had it dropped.
    assert all(any("G0" in d["reason"] for d in r["dropped"]) for r in reflections)


def test_reflection_fires_on_global_counts(two_ranks: tuple) -> None:
    _, run_dir = two_ranks
    selections = read_jsonl(run_dir / "selections.jsonl")
    reflections = read_jsonl(run_dir / "reflection.jsonl")
    queued = [r for r in selections if r["queued_for_reflection"]]
    assert len(reflections) == len(queued) // REFLECTION_BATCH
    counts = list(accumulate(int(r["queued_for_reflection"]) for r in selections))
    rank_of = {}
    for k, reflection in enumerate(reflections):
        records = queued[k * REFLECTION_BATCH : (k + 1) * REFLECTION_BATCH]
        assert reflection["records"] == [r["ticket_key"] for r in records]
        trigger = counts.index((k + 1) * REFLECTION_BATCH)  # the row where the global count got there
        assert reflection["trigger_ticket"] == selections[trigger]["ticket_key"]
        assert reflection["batch_index"] == selections[trigger]["batch_index"]
        rank_of[k] = {r["rank"] for r in records}
    # With 2 tickets per rank per batch, batch_size 3 is only reachable by pooling both ranks.
    assert any(ranks == {0, 1} for ranks in rank_of.values())
    first_batch = reflections[0]["batch_index"]
    assert len({r["ticket_key"] for r in queued if r["batch_index"] <= first_batch}) >= REFLECTION_BATCH


def test_selections_votes_review_and_malformed(two_ranks: tuple) -> None:
    _, run_dir = two_ranks
    selections = {(r["epoch"], r["ticket_key"]): r for r in read_jsonl(run_dir / "selections.jsonl")}
    unreadable = selections[(0, "u0::pass")]
    assert unreadable["verdict"] is None and unreadable["num_malformed"] == 4
    ambiguous = selections[(0, "a0::fail")]
    assert ambiguous["candidates_disagree"] and ambiguous["queued_for_reflection"]
    malformed = read_jsonl(run_dir / "failure_malformed.jsonl")
    assert {r["ticket_key"] for r in malformed} == {"u0::pass"} and len(malformed) == 8
    assert all("third-state" in r["format_error"] for r in malformed)
    review = {r["ticket_key"] for r in read_jsonl(run_dir / "need_review_queue.jsonl")}
    assert "u0::pass" in review
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) == 8 and sum(m["num_tickets"] for m in metrics) == 32
    assert metrics[-1]["accuracy"] is not None and metrics[-1]["tickets_per_s"] > 0
    assert metrics[-1]["fp_rate"] is not None and "fn_rate" in metrics[-1]


def test_two_ranks_select_exactly_like_one(one_rank: tuple, two_ranks: tuple) -> None:
    keys = (
        "epoch",
        "batch_index",
        "ticket_key",
        "verdict",
        "vote_strength",
        "num_pass",
        "num_fail",
        "guidance_step",
    )
    one = [{k: r[k] for k in keys} for r in read_jsonl(one_rank[1] / "selections.jsonl")]
    two = [{k: r[k] for k in keys} for r in read_jsonl(two_ranks[1] / "selections.jsonl")]
    assert one == two
    reflections_one = [(r["records"], r["accepted"]) for r in read_jsonl(one_rank[1] / "reflection.jsonl")]
    reflections_two = [(r["records"], r["accepted"]) for r in read_jsonl(two_ranks[1] / "reflection.jsonl")]
    assert reflections_one == reflections_two
    guidance = [
        json.loads((d / "guidance.json").read_text())["experiences"] for d in (one_rank[1], two_ranks[1])
    ]
    assert guidance[0] == guidance[1]
    assert "launching:" not in one_rank[0].stderr


def test_an_error_on_rank_one_fails_the_whole_run_fast(tmp_path: Path) -> None:
    """Through scripts/stage_b.sh with gpus=0,1 (two CPU ranks here); rank 1 raises in global batch 1."""
    config = write_config(tmp_path / "cfg.yaml", stage_b_config(tmp_path))
    (records := tmp_path / "processes").mkdir()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(p for p in (str(INJECT_DIR), os.environ.get("PYTHONPATH", "")) if p),
        "STAGECTL_FAULT_DIR": str(records),
        "STAGECTL_FAULT": "raise_in_judge:1:1",
        "gpus": "0,1",
        "config": str(config),
    }
    env.pop("WORLD_SIZE", None)
    start = time.monotonic()
    result = subprocess.run(
        ["bash", "scripts/stage_b.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "injected fault on rank 1 in global batch 1" in result.stderr
    assert "--nproc-per-node=2" in result.stderr
    assert elapsed < 40, f"took {elapsed:.1f}s; the watchdog deadline is 60 s"
    # Rank 0 consumed global batch 0 and could not go past batch 1's gather.
    selections = read_jsonl(tmp_path / "out" / "r" / MISSION / "selections.jsonl")
    assert {r["batch_index"] for r in selections} == {0}


def test_no_usable_ticket_is_a_one_line_error(tmp_path: Path) -> None:
    result, run_dir = run_stage_b(tmp_path, "--set", "mission=nobody")
    assert result.returncode == 1
    assert "no usable ticket of mission 'nobody'" in result.stderr and "Traceback" not in result.stderr
    assert not run_dir.exists()


def test_gpus_and_nproc_must_agree(tmp_path: Path) -> None:
    result, _ = run_stage_b(tmp_path, "--gpus", "0,1", "--nproc", "3")
    assert result.returncode == 1 and "--nproc 3 disagrees with --gpus 0,1" in result.stderr


def test_tiny_model_example_runs_end_to_end(tmp_path: Path) -> None:
    tickets = tmp_path / "tickets.jsonl"
    lines = (ROOT / "examples/tiny/stage_b/tickets.jsonl").read_text().splitlines()[:3]
    tickets.write_text("\n".join(lines) + "\n")
    result = run_cli(
        "stage-b",
        "examples/tiny/stage_b.yaml",
        "--set",
        f"output.root={tmp_path / 'out'}",
        "--set",
        f"tickets=[{tickets}]",
        "--set",
        "sampler.grid=[{max_new_tokens: 6, seed: 0}, {max_new_tokens: 6, seed: 1, temperature: 0}]",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model builtin:tiny-qwen2.5-vl on cpu" in result.stderr
    run_dir = tmp_path / "out" / "tiny" / "shapes_qc"
    trajectories = read_jsonl(run_dir / "trajectories.jsonl")
    assert len(trajectories) == 6 and all(r["guidance_step"] == 0 for r in trajectories)
    assert all(isinstance(r["text"], str) and (r["verdict"] or r["format_error"]) for r in trajectories)
    assert len(read_jsonl(run_dir / "selections.jsonl")) == 3


def test_rerun_is_refused_unless_resume_or_overwrite(tmp_path: Path) -> None:
    config = write_config(tmp_path / "cfg.yaml", stage_b_config(tmp_path, runner={"epochs": 1}))
    run_dir = tmp_path / "out" / "r" / MISSION
    first = run_cli("stage-b", str(config), timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    step = json.loads((run_dir / "guidance.json").read_text())["step"]
    assert step >= 1 and len(read_jsonl(run_dir / "selections.jsonl")) == 16
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    refused = run_cli("stage-b", str(config), timeout=120)
    assert refused.returncode == 1 and "already holds a run" in refused.stderr
    assert "--resume" in refused.stderr and "--overwrite" in refused.stderr
    assert {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    done = run_cli("stage-b", str(config), "--resume", timeout=120)  # every epoch ran: nothing to judge
    assert done.returncode == 0 and "nothing left to judge (raise runner.epochs to go on)" in done.stderr
    assert len(read_jsonl(run_dir / "selections.jsonl")) == 16
    second = run_cli("stage-b", str(config), "--resume", "--set", "runner.epochs=2", timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming at global batch 8 (epoch 1, 0 of its tickets judged) with guidance step {step}" in (
        second.stderr
    )
    selections = read_jsonl(run_dir / "selections.jsonl")
    assert len(selections) == 32 and {r["guidance_step"] for r in selections[16:]} == {step}
    assert {r["epoch"] for r in selections[16:]} == {1}
    third = run_cli("stage-b", str(config), "--overwrite", timeout=120)
    assert third.returncode == 0 and "starting from guidance step 0" in third.stderr
    assert "--overwrite: moved the previous run" in third.stderr
    assert len(read_jsonl(run_dir / "selections.jsonl")) == 16
    (aside,) = run_dir.parent.glob(f"{MISSION}.replaced-*")
    assert len(read_jsonl(aside / "selections.jsonl")) == 32  # the previous run, whole
