"""The Stage-B loop in process (rules engine, one rank): a stop asked for by a signal ends the run at a global
batch boundary with `progress.json` saying so, a second signal abandons the batch in flight, and `--resume`
continues from the boundary so that the run's files equal those of a run that was never stopped."""

from __future__ import annotations

import json
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from stagectl.config import load_config
from stagectl.config.plan_stage_b import StageBPlan, stage_b_plan
from stagectl.config.sampling import SamplingSpec
from stagectl.stage_b.engine import JudgeRequest, ReflectRequest
from stagectl.stage_b.engine_rules import RulesBackend
from stagectl.stage_b.runner import run_all
from stagectl.stopping import StopSignals
from tests.integration.helpers import stage_b_config, write_config

ROW_FILES = (
    "trajectories.jsonl",
    "selections.jsonl",
    "metrics.jsonl",
    "reflection.jsonl",
    "need_review_queue.jsonl",
    "failure_malformed.jsonl",
)
NUM_BATCHES = 16  # 16 tickets x 2 epochs, 2 per global batch (one rank)


def plan_for(root: Path, **sections: Any) -> StageBPlan:
    return stage_b_plan(load_config(write_config(root / "cfg.yaml", stage_b_config(root, **sections)), []))


class Interrupting(RulesBackend):
    """The rules engine, plus what a terminal would do at a chosen moment: a first signal while global
    batch `at_batch` is judged, or a second one inside the first reflection (rows of that batch written,
    the rest not)."""

    def __init__(
        self, stop: StopSignals, *, at_batch: int | None = None, in_reflection: bool = False
    ) -> None:
        self.stop = stop
        self.at_batch = at_batch
        self.in_reflection = in_reflection

    def judge(self, requests: Sequence[JudgeRequest], spec: SamplingSpec, seed: int) -> list[str]:
        if requests and requests[0].batch_index == self.at_batch:
            self.stop.signum = signal.SIGINT
        return super().judge(requests, spec, seed)

    def reflect(self, request: ReflectRequest, spec: SamplingSpec, seed: int) -> str:
        if self.in_reflection:
            self.stop.signum = signal.SIGINT
            raise KeyboardInterrupt
        return super().reflect(request, spec, seed)


def rows(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every artifact's rows without what depends on the clock."""
    out = {}
    for name in ROW_FILES:
        out[name] = [
            {
                k: v
                for k, v in json.loads(line).items()
                if k not in ("elapsed_s", "tickets_per_s", "updated_at")
            }
            for line in (run_dir / name).read_text().splitlines()
        ]
    for row in out["reflection.jsonl"]:
        for key in ("guidance_before", "guidance_after"):
            if isinstance(row.get(key), dict):
                row[key].pop("updated_at", None)
    return out


@pytest.fixture(scope="module")
def unstopped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    plan = plan_for(tmp_path_factory.mktemp("whole"))
    summary = run_all(plan)
    assert summary is not None and summary.stopped_by_signal is None and summary.num_batches == NUM_BATCHES
    progress = json.loads((plan.run_dir / "progress.json").read_text())
    assert (
        progress["status"] == "finished" and progress["epoch"] == 2 and progress["batch_index"] == NUM_BATCHES
    )
    return rows(plan.run_dir)


def test_a_signal_stops_after_the_batch_and_resume_writes_what_an_unstopped_run_writes(
    tmp_path: Path, unstopped: dict[str, list[dict[str, Any]]]
) -> None:
    plan = plan_for(tmp_path)
    stop = StopSignals()
    summary = run_all(plan, stop, engine=Interrupting(stop, at_batch=9))  # epoch 1, its 2nd batch
    assert summary is not None and summary.stopped_by_signal == signal.SIGINT
    assert summary.num_batches == 10 and summary.num_judged == 20  # batch 9 finished, then the stop
    progress = json.loads((plan.run_dir / "progress.json").read_text())
    assert (progress["status"], progress["stopped_by_signal"]) == ("stopped", signal.SIGINT)
    assert (progress["epoch"], progress["epoch_offset"], progress["batch_index"]) == (1, 4, 10)
    assert len(rows(plan.run_dir)["selections.jsonl"]) == 20

    resumed = run_all(plan)  # the CLI let --resume through: the run directory holds this run
    assert resumed is not None and resumed.stopped_by_signal is None
    assert (resumed.num_batches, resumed.num_judged) == (NUM_BATCHES, 32)
    assert rows(plan.run_dir) == unstopped
    assert json.loads((plan.run_dir / "progress.json").read_text())["status"] == "finished"


def test_a_second_signal_abandons_the_batch_and_resume_removes_what_it_wrote(
    tmp_path: Path, unstopped: dict[str, list[dict[str, Any]]]
) -> None:
    plan = plan_for(tmp_path)
    stop = StopSignals()
    with pytest.raises(KeyboardInterrupt):
        run_all(plan, stop, engine=Interrupting(stop, in_reflection=True))
    progress = json.loads((plan.run_dir / "progress.json").read_text())
    assert progress["status"] == "stopped" and progress["batch_index"] >= 1
    cut_off = rows(plan.run_dir)["selections.jsonl"]
    assert len(cut_off) > 2 * progress["batch_index"]  # rows of the abandoned batch are on disk

    resumed = run_all(plan)
    assert resumed is not None and resumed.num_judged == 32
    assert rows(plan.run_dir) == unstopped  # no row twice, none missing


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda p: p["consumer"].pop("queue"), "consumer.queue: Field required"),
        (
            lambda p: p["consumer"].update(num_judged=None),
            "consumer.num_judged: Input should be a valid integer",
        ),
        (
            lambda p: p["consumer"]["window"].update(num_seen=1),
            "consumer.window: unknown counter(s) num_seen",
        ),
        (lambda p: p.update(epoch="one"), "epoch: Input should be a valid integer"),
        (
            lambda p: p["artifact_bytes"].update({"../outside.txt": 0}),
            "artifact_bytes names '../outside.txt'",
        ),
    ],
)
def test_a_progress_file_that_is_not_one_is_an_error_naming_the_file_and_the_key(
    tmp_path: Path, edit: Any, named: str
) -> None:
    """A `progress.json` of another stagectl, or edited by hand: a key missing or of another type ended the
    resume with a KeyError / TypeError traceback (some only after the artifacts were cut back and config.yaml
    rewritten), and a file named in `artifact_bytes` outside the run directory was truncated."""
    plan = plan_for(tmp_path)
    stop = StopSignals()
    run_all(plan, stop, engine=Interrupting(stop, at_batch=3))
    path = plan.run_dir / "progress.json"
    progress = json.loads(path.read_text())
    edit(progress)
    path.write_text(json.dumps(progress))
    outside = plan.run_dir.parent / "outside.txt"
    outside.write_text("kept\n")
    before = {f: f.read_bytes() for f in plan.run_dir.rglob("*") if f.is_file()}

    with pytest.raises(ValueError) as info:
        run_all(plan)
    assert str(info.value).startswith(f"{path}: not a Stage-B progress file (")
    assert named in str(info.value)
    assert {f: f.read_bytes() for f in plan.run_dir.rglob("*") if f.is_file()} == before  # nothing written
    assert outside.read_text() == "kept\n"


class Mumbling(Interrupting):
    """Answers nothing in the verdict format (a random model), and stops where `Interrupting` does."""

    def judge(self, requests: Sequence[JudgeRequest], spec: SamplingSpec, seed: int) -> list[str]:
        super().judge(requests, spec, seed)
        return ["no idea"] * len(requests)


def test_tickets_without_a_verdict_are_counted_through_a_resume(tmp_path: Path) -> None:
    plan = plan_for(tmp_path)
    stop = StopSignals()
    stopped = run_all(plan, stop, engine=Mumbling(stop, at_batch=3))
    assert stopped is not None and (stopped.num_judged, stopped.num_no_verdict) == (8, 8)
    resumed = run_all(plan, engine=Mumbling(StopSignals()))
    assert resumed is not None and (resumed.num_judged, resumed.num_no_verdict) == (32, 32)


def test_resume_refuses_other_tickets(tmp_path: Path) -> None:
    plan = plan_for(tmp_path)
    stop = StopSignals()
    run_all(plan, stop, engine=Interrupting(stop, at_batch=0))
    tickets = Path(plan.tickets[0])
    lines = tickets.read_text().splitlines()
    tickets.write_text("\n".join(lines[1:]) + "\n")  # one ticket fewer: the epoch orders change
    with pytest.raises(ValueError, match=r"the tickets or runner.seed differ from those of the run in"):
        run_all(plan)


def test_a_resume_with_another_config_keeps_the_old_one_and_names_the_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """config.yaml is the record of how the rows were made: a resume with another sampler grid used to
    overwrite it silently, so the run directory no longer said how its first batches were judged."""
    plan = plan_for(tmp_path)
    stop = StopSignals()
    run_all(plan, stop, engine=Interrupting(stop, at_batch=3))
    before = (plan.run_dir / "config.yaml").read_text()
    changed = plan_for(tmp_path, sampler={"grid": [{"seed": 0}, {"seed": 5}], "samples_per_decode": 2})
    capsys.readouterr()
    resumed = run_all(changed)
    assert resumed is not None and resumed.num_judged == 32
    kept = plan.run_dir / "config.batch-4.yaml"
    assert kept.read_text() == before
    assert "seed: 5" in (plan.run_dir / "config.yaml").read_text()
    err = capsys.readouterr().err
    grid = "{'temperature': 0.7, 'top_p': 0.9, 'max_new_tokens': 128, 'seed': %d}"
    assert (
        "stage-b: warning: the resumed config differs from the one that judged global batches 0..3 (1 key): "
        f"sampler.grid: [{grid % 0}, {grid % 1}] -> [{grid % 0}, {grid % 5}]. That config is kept as {kept} "
        "and config.yaml holds the new values"
    ) in err


def test_a_mission_named_as_upstream_names_them_runs(tmp_path: Path) -> None:
    """Upstream's missions are its data directories' names (`挡风板安装检查`, written with ensure_ascii=False);
    the runner refused them ("must be a plain name (letters, digits, _ . -)")."""
    mission = "挡风板安装检查"
    plan = plan_for(tmp_path, mission=mission)
    tickets = Path(plan.tickets[0])
    tickets.write_text(
        tickets.read_text().replace(
            '"mission": "qc"', json.dumps({"mission": mission}, ensure_ascii=False)[1:-1]
        ),
        encoding="utf-8",
    )
    summary = run_all(plan)
    assert summary is not None and summary.num_judged == 32
    assert plan.run_dir.name == mission and (plan.run_dir / "progress.json").is_file()


def test_a_group_labelled_both_ways_runs_as_two_tickets_and_the_start_line_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = plan_for(tmp_path)
    tickets = Path(plan.tickets[0])
    lines = tickets.read_text().splitlines()
    first = json.loads(lines[0])
    other = {**first, "label": "pass" if first["label"] == "fail" else "fail"}
    tickets.write_text("\n".join([*lines, json.dumps(other)]) + "\n")
    summary = run_all(plan)
    assert summary is not None and summary.num_tickets == 17 and summary.num_judged == 34  # 2 epochs
    assert (
        f"1 group(s) labelled both pass and fail, each label a ticket of its own (group_id::label, as upstream "
        f"keys them): {first['group_id']} ({tickets}:1 and {tickets}:{len(lines) + 1})"
    ) in capsys.readouterr().err


def test_a_resume_with_the_same_config_keeps_no_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = plan_for(tmp_path)
    stop = StopSignals()
    run_all(plan, stop, engine=Interrupting(stop, at_batch=3))
    capsys.readouterr()
    run_all(plan_for(tmp_path))
    assert not list(plan.run_dir.glob("config.batch-*.yaml"))
    assert "differs" not in capsys.readouterr().err


class ServerGone(RulesBackend):
    """The rules engine, whose server stops answering while global batch `at_batch` is judged."""

    def __init__(self, at_batch: int) -> None:
        self.at_batch = at_batch

    def judge(self, requests: Sequence[JudgeRequest], spec: SamplingSpec, seed: int) -> list[str]:
        if requests and requests[0].batch_index == self.at_batch:
            from stagectl.wire.errors import RolloutServerError

            raise RolloutServerError("rollout http://127.0.0.1:9 requests [0, 2) seed=9: server gone")
        return super().judge(requests, spec, seed)


def test_an_error_marks_the_run_failed_with_its_message_and_resume_continues_from_the_boundary(
    tmp_path: Path, unstopped: dict[str, list[dict[str, Any]]]
) -> None:
    """progress.json of a run an error ended says `failed` and why (the report and a refused restart read
    it; it used to stay `running`, "still running, or killed"); the position stays the last boundary."""
    from stagectl.stage_b.progress import describe, read_progress
    from stagectl.wire.errors import RolloutServerError

    plan = plan_for(tmp_path)
    with pytest.raises(RolloutServerError):
        run_all(plan, engine=ServerGone(at_batch=9))
    progress = read_progress(plan.run_dir)
    assert progress is not None and progress.status == "failed" and progress.batch_index == 9
    assert progress.error == "rollout http://127.0.0.1:9 requests [0, 2) seed=9: server gone"
    assert describe(progress) == "failed before global batch 9 (epoch 1)"

    resumed = run_all(plan)
    assert resumed is not None and resumed.num_judged == 32
    assert rows(plan.run_dir) == unstopped
    done = read_progress(plan.run_dir)
    assert done is not None and (done.status, done.error) == ("finished", None)


class Watching(RulesBackend):
    """The rules engine, noting whether `running.json` names this process while a batch is judged."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.seen: list[bool] = []

    def judge(self, requests: Sequence[JudgeRequest], spec: SamplingSpec, seed: int) -> list[str]:
        import os

        from stagectl.rundir.liveness import running_process

        proc = running_process(self.run_dir)
        self.seen.append(proc is not None and proc.pid == os.getpid() and bool(proc.alive))
        return super().judge(requests, spec, seed)


def test_running_json_names_rank_0_while_the_loop_runs_and_goes_when_it_ends(tmp_path: Path) -> None:
    from stagectl.rundir.liveness import RUNNING

    plan = plan_for(tmp_path)
    engine = Watching(plan.run_dir)
    run_all(plan, engine=engine)
    assert engine.seen and all(engine.seen)
    assert not (plan.run_dir / RUNNING).exists()
    (tmp_path / "failing").mkdir()
    failing = plan_for(tmp_path / "failing")
    with pytest.raises(Exception, match="server gone"):
        run_all(failing, engine=ServerGone(at_batch=1))
    assert not (failing.run_dir / RUNNING).exists()  # an error ends it too
