"""Lossless async resume: a 2-rank async run SIGKILLed after a checkpoint, inside a weight sync, or in the
middle of a checkpoint write, then resumed from `latest`, trains what the same run trains uninterrupted.

Always checked, read from `samples.jsonl`: the number of steps; no stream position trained twice; Channel-A
skips no position. Equal to the uninterrupted run: the number of steps and each step's channel; the multiset
of (channel, sample id); and, per rank and channel, the set of (stream position, sample id) - nothing trained
twice, nothing skipped. Which step trains a given B sample may differ (a queued pack may be trained one B
step earlier or later, within the version window), so per-step B contents are not compared.

The runs use `training.packing: false` (a ready pack is exactly `per_device_train_batch_size` rollouts, so
the samples a B step trains do not depend on rollout lengths) and the `wait_for_packs` test hook (a step
that wants Channel-B waits for its packs, and each version's bursts finish before the sync that ends it, so
neither a step's channel nor a burst's version depends on timing): without them two *uninterrupted* runs
would already differ.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from stagectl.learner.samples import read_samples
from tests.faults.helpers import fault_run, report
from tests.integration.helpers import async_config, write_config

MAX_STEPS = 8
WAIT = "wait_for_packs:90"
# Finding (stop 23): the two ranks' prefetchers could each queue a full group of a DIFFERENT eligible version
# (a burst before a weight sync on one rank, after it on the other); each rank's pacing counted its own group
# as covering the next B step, neither produced more, and that B step trained Channel-A: the comparison
# below failed twice in ~6 runs. Fixed in the product (pacing counts an older group only if every rank holds
# it: `ReadyPackQueue.set_shared`); the `wait_for_packs` hook also makes each rank finish the bursts pacing
# wants at a version before the sync that ends it, so which version a burst gets does not depend on timing.


def _config(run_root: Path, max_steps: int = MAX_STEPS) -> Path:
    cfg = async_config(
        run_root,
        training={"max_steps": max_steps, "save_steps": 2, "packing": False},
        stage2_ab={"channel_b": {"async": {"version_window": 2}}},
    )
    run_root.mkdir(parents=True, exist_ok=True)
    return write_config(run_root / "cfg.yaml", cfg)


def _trained(run_dir: Path) -> dict[str, object]:
    rows = read_samples(run_dir / "samples.jsonl")
    steps = sorted({r["step"] for r in rows})
    channels = {s: {r["channel"] for r in rows if r["step"] == s} for s in steps}
    per_stream: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for r in rows:
        per_stream.setdefault((r["channel"], r["rank"]), []).append((r["stream_pos"], r["sample"]))
    return {
        "steps": steps,
        "channels": channels,
        "multiset": Counter((r["channel"], r["sample"]) for r in rows),
        "streams": {key: sorted(v) for key, v in per_stream.items()},
    }


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("whole")
    with fault_run(["train-ab", str(_config(root))], root, fault=WAIT) as run:
        assert run.finish(400) == 0, run.tail()
    return root / "run"


@pytest.fixture(scope="module")
def uninterrupted(whole_run: Path) -> dict[str, object]:
    return _trained(whole_run)


@pytest.mark.parametrize(
    ("kill", "resumes_from"),
    [
        ("kill_at_step:5", 4),  # between checkpoints, packs queued and a burst likely in flight
        ("kill_in_push:3", 4),  # inside the weight sync after update 6 (before checkpoint-6)
        ("kill_in_checkpoint:4", 2),  # checkpoint-4 half written: the previous one is `latest`
    ],
)
def test_async_run_killed_and_resumed_trains_what_the_uninterrupted_run_trains(
    kill: str, resumes_from: int, uninterrupted: dict[str, object], tmp_path: Path
) -> None:
    config = _config(tmp_path)
    with fault_run(["train-ab", str(config)], tmp_path, fault=f"{WAIT};{kill}", name="killed") as run:
        code = run.finish(400)
        assert run.fault_times(), run.tail()
        assert code != 0, run.tail()
    run_dir = tmp_path / "run"
    checkpoints = sorted(p.name for p in run_dir.glob("checkpoint-*"))
    assert checkpoints[-1] == f"checkpoint-{resumes_from}", checkpoints
    args = ["train-ab", str(config), "--set", "training.resume_from_checkpoint=latest"]
    with fault_run(args, tmp_path, fault=WAIT, name="resumed") as run:
        assert run.finish(400) == 0, run.tail()
        output = run.output()
    assert f"resumed the async state of checkpoint-{resumes_from}" in output
    assert "holds no async state" not in output
    resumed = _trained(run_dir)
    assert resumed["steps"] == list(range(MAX_STEPS)) == uninterrupted["steps"]
    streams: dict[tuple[str, int], list[tuple[int, int]]] = resumed["streams"]  # type: ignore[assignment]
    for (channel, rank), trained in streams.items():
        positions = [pos for pos, _ in trained]
        assert len(set(positions)) == len(positions), (
            f"{channel} rank {rank}: a stream position trained twice"
        )
        if channel == "A":  # Channel-A drops nothing: positions 0..n-1, none skipped
            assert positions == list(range(len(positions))), f"A rank {rank}: {positions}"
    assert streams.get(("B", 0)), "no B sample trained"
    assert resumed["channels"] == uninterrupted["channels"]
    assert resumed["multiset"] == uninterrupted["multiset"]
    assert resumed["streams"] == uninterrupted["streams"]
    report(fault=f"async resume after {kill}", survived=True, resumed_from=resumes_from, data_lost=0)


def test_a_checkpoint_without_async_state_resumes_with_a_warning(whole_run: Path, tmp_path: Path) -> None:
    """A checkpoint in the format written before async state was saved (no `async_state.pt`, no
    `ver_is_weights`, no `a_buffer_pos`, `b_consumed` = everything the prefetcher had taken) still resumes;
    it says its async state was not saved, and the B stream goes on after what had been taken."""
    config = _config(tmp_path)
    old = tmp_path / "run" / "checkpoint-4"
    shutil.copytree(whole_run / "checkpoint-4", old)
    (old / "async_state.pt").unlink()
    state = json.loads((old / "trainer_state.json").read_text())
    state["extra"].pop("ver_is_weights")
    queued = []
    for rank in state["data_state"]["ranks"]:
        rank.pop("a_buffer_pos")
        queued.append(rank["b_consumed"])
        rank["b_consumed"] += 3  # the old rule: taken counts, trained or not
    (old / "trainer_state.json").write_text(json.dumps(state))
    args = ["train-ab", str(config), "--set", "training.resume_from_checkpoint=latest"]
    with fault_run(args, tmp_path, fault=WAIT, name="old") as run:
        assert run.finish(400) == 0, run.tail()
        output = run.output()
    assert "checkpoint-4 holds no async state" in output and "were not saved" in output
    rows = read_samples(tmp_path / "run" / "samples.jsonl")
    assert rows and min(r["step"] for r in rows) == 4
    for rank, taken in enumerate(queued):
        b_positions = [r["stream_pos"] for r in rows if r["channel"] == "B" and r["rank"] == rank]
        assert (
            b_positions and min(b_positions) == taken + 3
        )  # the queued packs were lost, as the warning says
