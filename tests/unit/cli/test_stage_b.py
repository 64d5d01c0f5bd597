"""`stagectl stage-b`: its argument helpers, and its launcher and ranks around the resolved plan (the
launcher parses the YAML once and resolves a `StageBPlan`; torchrun's ranks get it as a file, `--plan`, and
never parse the YAML). torchrun is a stand-in here; the command end to end is in tests/integration."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml
from typer.testing import CliRunner

from stagectl.cli.app import app
from stagectl.cli.stage_b import parse_gpus
from stagectl.config import load_config
from stagectl.config.plan_stage_b import StageBPlan, read_stage_b_plan, stage_b_plan, write_stage_b_plan
from stagectl.dist import World
from stagectl.stage_b.engine import rank_device

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples/tiny/stage_b.yaml"
EXAMPLE = ROOT / "examples/tiny/stage_b"


def test_parse_gpus() -> None:
    assert parse_gpus("0") == ["0"]
    assert parse_gpus("0, 1,3") == ["0", "1", "3"]


@pytest.mark.parametrize("text", ["", "a", "0,,1", "-1", "0,0", "0;1"])
def test_parse_gpus_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="--gpus"):
        parse_gpus(text)


def test_each_rank_holds_the_full_model_on_its_local_device() -> None:
    assert rank_device(World(rank=5, local_rank=1, world_size=8), cuda_available=True) == "cuda:1"
    assert rank_device(World(rank=0, local_rank=0, world_size=1), cuda_available=True) == "cuda:0"
    assert rank_device(World(rank=1, local_rank=1, world_size=2), cuda_available=False) == "cpu"


# ---------------------------------------------------------------- the launcher and its ranks around the plan


def _sets(root: Path) -> list[str]:
    """The tiny example on the rules engine, its inputs by absolute path, its run under `root`."""
    return [
        "runner.engine=rules",
        f"tickets=[{EXAMPLE}/tickets.jsonl]",
        f"guidance.path={EXAMPLE}/guidance.json",
        f"output.root={root}",
        "runner.epochs=2",
    ]


def _set_args(sets: list[str]) -> list[str]:
    return [arg for s in sets for arg in ("--set", s)]


def _no_yaml(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("a rank started with a plan parsed the YAML")


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("STAGECTL_LAUNCHED", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank the launcher started (a world of one here): parsing a YAML raises."""
    import stagectl.config
    import stagectl.config.loader

    monkeypatch.setattr(stagectl.config, "load_config", _no_yaml)
    monkeypatch.setattr(stagectl.config.loader, "load_config", _no_yaml)


def test_a_rank_started_with_a_plan_file_runs_that_plan_without_parsing_the_yaml(tmp_path: Path) -> None:
    plan = stage_b_plan(load_config(TINY, [*_sets(tmp_path / "out"), "launch.nproc_per_node=2"]))
    path = write_stage_b_plan(tmp_path / "plan.json", plan)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("stagectl.config.load_config", _no_yaml)
        patch.setattr("stagectl.config.loader.load_config", _no_yaml)
        result = CliRunner().invoke(app, ["stage-b", str(tmp_path / "gone.yaml"), "--plan", str(path)])
    assert result.exit_code == 0, result.output
    assert "stage-b: done, 32 tickets judged" in result.output  # 16 tickets x the plan's runner.epochs=2
    # rank 0 keeps the plan it ran beside config.yaml, which is the launcher's resolved config
    assert read_stage_b_plan(plan.run_dir / "plan.json") == plan
    assert yaml.safe_load((plan.run_dir / "config.yaml").read_text()) == plan.resolved_config


@pytest.mark.usefixtures("rank")
def test_a_rank_with_a_missing_or_corrupt_plan_file_fails_in_one_line(tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    missing = CliRunner().invoke(app, ["stage-b", "cfg.yaml", "--plan", str(plan_file)])
    assert missing.exit_code == 1
    assert (
        missing.output
        == f"error: {plan_file}: the resolved plan the launcher writes for the ranks is missing\n"
    )
    plan_file.write_text('{"mission": "m"')
    corrupt = CliRunner().invoke(app, ["stage-b", "cfg.yaml", "--plan", str(plan_file)])
    assert corrupt.exit_code == 1 and corrupt.output.count("\n") == 1
    assert corrupt.output.startswith(f"error: {plan_file}: not a stage-b plan this stagectl can read: ")
    plan_file.write_text('{"plan": {"mission": "m"}}')
    partial = CliRunner().invoke(app, ["stage-b", "cfg.yaml", "--plan", str(plan_file)])
    assert partial.exit_code == 1 and partial.output.count("\n") == 1
    assert "not a stage-b plan this stagectl can read: tickets: Field required" in partial.output


@pytest.mark.usefixtures("rank")
@pytest.mark.parametrize(
    "extra",
    [["--set", "runner.epochs=1"], ["--nproc", "2"], ["--gpus", "0,1"], ["--resume"], ["--overwrite"]],
)
def test_a_plan_takes_no_user_options(extra: list[str], tmp_path: Path) -> None:
    path = write_stage_b_plan(tmp_path / "plan.json", stage_b_plan(load_config(TINY, _sets(tmp_path))))
    result = CliRunner().invoke(app, ["stage-b", "cfg.yaml", "--plan", str(path), *extra])
    assert result.exit_code == 1
    assert result.output == (
        "error: --plan (the launcher's option for its torchrun ranks) takes no --set, --gpus, --nproc, --resume or "
        "--overwrite\n"
    )
    assert not (tmp_path / "tiny").exists()  # nothing ran


def test_the_launcher_hands_torchrun_the_plan_with_the_sets_resolved_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stagectl.launch
    import stagectl.stage_b.runner

    launched: list[tuple[list[str], StageBPlan, str | None]] = []

    def torchrun(args: list[str], launch: Any, on_signal: Any = None) -> int:
        plan = read_stage_b_plan(Path(args[args.index("--plan") + 1]))  # the file is gone once the ranks are
        launched.append((list(args), plan, os.environ.get("CUDA_VISIBLE_DEVICES")))
        assert launch.nproc_per_node == 2
        return 0

    def no_run(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError("the launcher of two ranks ran the loop itself")

    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", torchrun)
    monkeypatch.setattr(stagectl.stage_b.runner, "run_all", no_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # restored after the test
    sets = [*_sets(tmp_path / "out"), "runner.seed=41"]
    result = CliRunner().invoke(app, ["stage-b", str(TINY), "--gpus", "2,3", *_set_args(sets)])
    assert result.exit_code == 0, result.output
    ((args, plan, devices),) = launched
    assert args[:2] == ["stage-b", str(TINY)] and args[2] == "--plan" and len(args) == 4
    assert not Path(args[3]).exists()  # removed after the ranks exit
    assert devices == "2,3"  # the ranks inherit --gpus as CUDA_VISIBLE_DEVICES
    assert plan == stage_b_plan(load_config(TINY, [*sets, "launch.nproc_per_node=2"], world_size=2))
    assert plan.runner.seed == 41 and plan.runner.epochs == 2 and plan.backend.kind == "rules"
    assert plan.resolved_config["launch"]["nproc_per_node"] == 2  # what rank 0 writes to config.yaml
    assert not plan.run_dir.exists()  # only the ranks write the run directory


def test_one_process_runs_the_plan_it_resolved_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stagectl.launch
    import stagectl.stage_b.runner

    ran: list[StageBPlan] = []

    def no_torchrun(args: list[str], launch: Any, on_signal: Any = None) -> NoReturn:
        raise AssertionError("a one-process run started torchrun")

    def run_all(plan: StageBPlan, stop: Any = None) -> None:
        ran.append(plan)

    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", no_torchrun)
    monkeypatch.setattr(stagectl.stage_b.runner, "run_all", run_all)
    sets = _sets(tmp_path / "out")
    result = CliRunner().invoke(app, ["stage-b", str(TINY), *_set_args(sets)])
    assert result.exit_code == 0, result.output
    assert ran == [stage_b_plan(load_config(TINY, sets))]


def test_the_processes_are_the_configs_whatever_world_size_the_environment_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher read `$WORLD_SIZE` from its own environment (left there by another job): `WORLD_SIZE=1` ran
    a `launch.nproc_per_node: 2` config as one process, and `WORLD_SIZE=2` started torchrun for a one-process
    run. It starts what the config (or --nproc / --gpus) says, as train-ab does, and the one process it runs
    itself reads a world of one."""
    import stagectl.launch
    import stagectl.stage_b.runner
    from stagectl import dist

    started: list[str] = []

    def torchrun(args: list[str], launch: Any, on_signal: Any = None) -> int:
        started.append(f"torchrun x{launch.nproc_per_node}")
        return 0

    def run_all(plan: StageBPlan, stop: Any = None) -> None:
        started.append(f"in process, world {dist.read_world().world_size}")

    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", torchrun)
    monkeypatch.setattr(stagectl.stage_b.runner, "run_all", run_all)
    for name in ("STAGECTL_LAUNCHED", "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for env, nproc, expected in [("1", 2, "torchrun x2"), ("2", 1, "in process, world 1")]:
        monkeypatch.setenv("WORLD_SIZE", env)
        started.clear()
        sets = [*_sets(tmp_path / f"out{env}"), f"launch.nproc_per_node={nproc}"]
        result = CliRunner().invoke(app, ["stage-b", str(TINY), *_set_args(sets)])
        assert result.exit_code == 0, result.output
        assert started == [expected], (env, nproc)


def _stopped_progress(run_dir: Path, signum: int) -> None:
    from stagectl.stage_b.progress import Progress, write_progress

    run_dir.mkdir(parents=True)
    write_progress(
        run_dir, Progress("digest", epoch=1, batch_index=5, status="stopped", stopped_by_signal=signum)
    )


def test_a_stopped_one_process_run_prints_how_to_continue_and_exits_128_plus_the_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The Ctrl-C says at once what the stop waits for (the batch in flight), then the stop line."""
    import signal

    import stagectl.stage_b.runner
    from stagectl.stage_b.runner import RunSummary

    def run_all(plan: StageBPlan, stop: Any = None) -> RunSummary:
        signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, during the batch
        _stopped_progress(plan.run_dir, signal.SIGINT)
        return RunSummary(plan.run_dir, 16, 5, 10, 0.5, 1, 1, signal.SIGINT, 0, [])

    monkeypatch.setattr(stagectl.stage_b.runner, "run_all", run_all)
    try:
        result = CliRunner().invoke(app, ["stage-b", str(TINY), *_set_args(_sets(tmp_path / "out"))])
    finally:  # the command ignores further signals once stopped (it ends right after)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert capfd.readouterr().err.count("stage-b: stopping after the current batch") == 1
    assert result.exit_code == 130, result.output
    run_dir = tmp_path / "out" / "tiny" / "shapes_qc"
    assert result.output.strip().splitlines()[-1] == (
        f"stage-b: stopped by SIGINT before global batch 5 (epoch 1); progress saved in {run_dir}/progress.json. "
        f"Continue with: stagectl stage-b {TINY} --resume and the same --set/--gpus/--nproc options"
    )
    assert "done," not in result.output


def test_a_run_whose_answers_are_all_malformed_says_so_in_its_log_and_end_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that never answers in the `Verdict:` / `Reason:` format (the random tiny model) ran to `done, ...
    accuracy 0.000` with every batch line `accuracy 0.000`, as if it had judged every ticket wrong."""
    from stagectl.stage_b.engine_rules import RulesBackend

    monkeypatch.setattr(
        RulesBackend, "judge", lambda self, requests, spec, seed: ["<|coord_5|>"] * len(requests)
    )
    result = CliRunner().invoke(app, ["stage-b", str(TINY), *_set_args(_sets(tmp_path / "out"))])
    assert result.exit_code == 0, result.output
    assert (
        "stage-b: batch 0: 4 tickets, accuracy 0.000 (4 without a verdict: malformed answers), "
        in result.output
    )
    assert "stage-b: warning: 32 of 32 tickets got no verdict: no candidate answered in the " in result.output


def test_the_launcher_reports_a_stop_its_ranks_made_with_the_signal_it_got(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Ranks stopped by a forwarded Ctrl-C exit 0 (torchrun has no failure to report); the launcher prints the
    stop line and exits 130."""
    import signal

    import stagectl.launch

    def torchrun(args: list[str], launch: Any, on_signal: Any = None) -> int:
        on_signal(signal.SIGINT)  # the user's Ctrl-C, forwarded to the ranks
        plan = read_stage_b_plan(Path(args[args.index("--plan") + 1]))
        _stopped_progress(plan.run_dir, signal.SIGINT)  # what rank 0 records
        return 0

    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", torchrun)
    result = CliRunner().invoke(
        app, ["stage-b", str(TINY), "--nproc", "2", *_set_args(_sets(tmp_path / "out"))]
    )
    assert result.exit_code == 130, result.output
    assert (
        result.output.strip()
        .splitlines()[-1]
        .startswith("stage-b: stopped by SIGINT before global batch 5 (epoch 1); progress saved in ")
    )
    assert capfd.readouterr().err.count("stage-b: stopping after the current batch") == 1


def test_a_run_whose_rollout_server_is_gone_says_what_is_saved_and_how_to_continue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`runner.engine: server` with no server left: one error line (it was a RolloutServerError traceback)
    naming the server's error, the saved progress and the resume command."""
    import stagectl.stage_b.runner
    from stagectl.stage_b.progress import Progress, write_progress
    from stagectl.wire.errors import RolloutServerError

    def run_all(plan: StageBPlan, stop: Any = None) -> NoReturn:
        plan.run_dir.mkdir(parents=True)
        write_progress(plan.run_dir, Progress("digest", epoch=7, batch_index=29, status="running"))
        raise RolloutServerError("rollout http://127.0.0.1:9 requests [0, 4) seed=1: server gone")

    monkeypatch.setattr(stagectl.stage_b.runner, "run_all", run_all)
    result = CliRunner().invoke(app, ["stage-b", str(TINY), *_set_args(_sets(tmp_path / "out"))])
    assert result.exit_code == 1, result.output
    run_dir = tmp_path / "out" / "tiny" / "shapes_qc"
    assert result.output.strip().splitlines()[-1] == (
        "error: rollout http://127.0.0.1:9 requests [0, 4) seed=1: server gone. Progress is saved before global "
        f"batch 29 (epoch 7) in {run_dir}/progress.json; once a server answers (runner.server.base_urls), "
        f"continue with: stagectl stage-b {TINY} --resume and the same --set/--gpus/--nproc options"
    )
    assert "Traceback" not in result.output


@pytest.mark.usefixtures("rank")
@pytest.mark.parametrize("shared", [False, True])
def test_a_rank_other_than_0_reports_an_error_of_its_own_shard_and_not_a_shared_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """An error of rank 1's own shard (its ticket too long for the model, its server chunk refused) was never
    printed: rank 1 exited 1 silently as if rank 0 reported the same error, and rank 0 ended on a gloo
    `Connection closed by peer ... Check the logs of the remote worker`. A start-up error every rank raises
    alike is still reported by rank 0 only."""
    import stagectl.stage_b.runner

    error = stagectl.stage_b.runner.StartUpError if shared else ValueError

    def run_all(plan: StageBPlan, stop: Any = None) -> NoReturn:
        raise error("ticket g6::fail: its rollout prompt does not fit the model")

    plan = stage_b_plan(load_config(TINY, [*_sets(tmp_path / "out"), "launch.nproc_per_node=2"]))
    path = write_stage_b_plan(tmp_path / "plan.json", plan)
    monkeypatch.setattr(stagectl.stage_b.runner, "run_all", run_all)
    monkeypatch.setenv("RANK", "1")
    result = CliRunner().invoke(app, ["stage-b", str(TINY), "--plan", str(path)])
    assert result.exit_code == 1
    expected = "" if shared else "error: rank 1: ticket g6::fail: its rollout prompt does not fit the model\n"
    assert result.output == expected


def test_a_second_stage_b_in_a_live_runs_directory_is_refused(tmp_path: Path) -> None:
    """A job started twice: the first run's rank 0 is alive (`running.json`), so `--resume` is refused, not
    run next to it over the same artifacts."""
    import json
    import os
    import socket

    run_dir = tmp_path / "out" / "tiny" / "shapes_qc"
    run_dir.mkdir(parents=True)
    alive = os.getppid()  # a live process that is not this one: the first run's rank 0
    (run_dir / "running.json").write_text(
        json.dumps({"pid": alive, "host": socket.gethostname(), "started": None})
    )
    result = CliRunner().invoke(app, ["stage-b", str(TINY), "--resume", *_set_args(_sets(tmp_path / "out"))])
    assert result.exit_code == 1, result.output
    assert f"is in use: a stage-b run is running (pid {alive} on" in result.output
    assert sorted(p.name for p in run_dir.iterdir()) == ["running.json"]


def test_a_run_directory_that_cannot_be_written_is_refused_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """output.root under a file: rank 0 found it only when it first wrote the run directory, after the
    model (engine: model) had loaded; the launcher now refuses it, naming the key, and starts nothing."""
    import stagectl.launch
    import stagectl.stage_b.runner

    def started(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError("the run started; the launcher should have refused output.root")

    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", started)
    monkeypatch.setattr(stagectl.stage_b.runner, "run_all", started)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for nproc in ([], ["--nproc", "2"]):
        result = CliRunner().invoke(app, ["stage-b", str(TINY), *nproc, *_set_args(_sets(blocker / "out"))])
        assert result.exit_code == 1, result.output
        assert (
            f"error: output.root: cannot write to {blocker}/out/tiny/shapes_qc: {blocker} is a file, "
            "not a directory"
        ) in result.output


def test_a_model_whose_chat_template_does_not_compile_is_refused_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runner.engine: model rendered the template at the first rollout, after the model had loaded and the
    run directory was written, and ended on a traceback; the launcher now refuses it, naming the file."""
    import json

    import stagectl.launch
    import stagectl.stage_b.runner

    def started(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError("the run started; the launcher should have refused the chat template")

    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", started)
    monkeypatch.setattr(stagectl.stage_b.runner, "run_all", started)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    (model / "chat_template.jinja").write_text("{{ messages[0] ")
    sets = [*_sets(tmp_path / "out"), "runner.engine=model", f"model.name_or_path={model}"]
    result = CliRunner().invoke(app, ["stage-b", str(TINY), *_set_args(sets)])
    assert result.exit_code == 1, result.output
    assert (
        f"error: model.name_or_path: {model / 'chat_template.jinja'}: the chat template does not compile"
        in (result.output)
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]])
def test_a_resume_of_a_finished_run_starts_no_rank_and_loads_no_model(
    nproc: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--resume` of a run that judged every epoch said "nothing left to judge" only after rank 0 had read the
    tickets and every rank had loaded its model (minutes for a 7B; torchrun's ranks under --nproc), and rewrote
    config.yaml and plan.json; train-ab's finished-run resume starts nothing. The launcher now says it first."""
    import stagectl.launch
    import stagectl.stage_b.runner
    from stagectl.stage_b.progress import Progress, write_progress

    def no_rank(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError("a resume with nothing left to judge started the loop")

    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", no_rank)
    monkeypatch.setattr(stagectl.stage_b.runner, "run_all", no_rank)
    run_dir = tmp_path / "out" / "tiny" / "shapes_qc"
    run_dir.mkdir(parents=True)
    (run_dir / "guidance.json").write_text("{}")  # a run is there
    write_progress(run_dir, Progress("digest", epoch=2, batch_index=8, status="finished"))
    before = sorted(p.name for p in run_dir.iterdir())
    sets = _set_args(_sets(tmp_path / "out"))  # runner.epochs=2: both judged
    result = CliRunner().invoke(app, ["stage-b", str(TINY), "--resume", *nproc, *sets])
    assert result.exit_code == 0, result.output
    assert (
        f"stage-b: {run_dir} has judged all 2 epoch(s) (runner.epochs): nothing left to judge (raise "
        "runner.epochs to go on); nothing was started"
    ) in result.output
    assert sorted(p.name for p in run_dir.iterdir()) == before  # no config.yaml / plan.json rewritten
    # a raised runner.epochs goes on
    ran: list[StageBPlan] = []
    monkeypatch.setattr(stagectl.stage_b.runner, "run_all", lambda plan, stop=None: ran.append(plan))
    more = CliRunner().invoke(app, ["stage-b", str(TINY), "--resume", *sets, "--set", "runner.epochs=3"])
    assert more.exit_code == 0, more.output
    assert len(ran) == 1 and ran[0].runner.epochs == 3
