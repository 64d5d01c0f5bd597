"""`stagectl train-ab`'s launcher and ranks around the resolved plan: the launcher parses the YAML once and
resolves a `TrainPlan`; torchrun's ranks get it as a file (`--plan`) and never parse the YAML; a one-rank
run trains the same plan in-process. The trainer and torchrun are stand-ins: what is checked is which plan
reaches them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, NoReturn

import pytest
from typer.testing import CliRunner

from stagectl.cli.app import app
from stagectl.cli.train_ab import STOP_NOTICE
from stagectl.config import load_config, to_plain
from stagectl.config.plan_train import TrainPlan, read_train_plan, train_plan, write_train_plan

ROOT = Path(__file__).resolve().parents[3]
ASYNC = ROOT / "examples/tiny/train_ab_async.yaml"
TINY = ROOT / "examples/tiny/train_ab.yaml"


INTERRUPTED_EARLY = "train-ab: interrupted (SIGINT) before its first step; nothing new was saved"


def _sets(out: Path) -> list[str]:
    """The async example against a server that is never called, with two overrides to follow."""
    return [
        f"training.output_dir={out}",
        "training.learning_rate=0.00123",
        "stage2_ab.channel_b.async.queue_limit=5",
        "rollout_server.embedded=false",
        "custom.extra.rollout_matching.vllm.server.servers=[{base_url: 'http://127.0.0.1:9'}]",
    ]


def _set_args(sets: list[str]) -> list[str]:
    return [arg for s in sets for arg in ("--set", s)]


class _Trainer:
    """Takes the plan the rank would train and stops at once."""

    seen: ClassVar[list[TrainPlan]] = []
    notices: ClassVar[list[str | None]] = []  # the line each one's first stop signal would print

    def __init__(
        self,
        plan: TrainPlan,
        *,
        prefetcher_cpus: tuple[int, ...] | None = None,
        stop_notice: str | None = None,
    ) -> None:
        self.seen.append(plan)
        self.notices.append(stop_notice)
        self.stopped_by_signal: int | None = None
        self.aborted_by_signal: int | None = None
        self.b_steps: Any = SimpleNamespace(
            summary_line=lambda: "B steps: none", off_schedule=lambda tolerance: None
        )
        self.steps_done, self.b_steps_done = 0, {"num_steps": 0}

    def run(self) -> int:
        return 0


@pytest.fixture
def trainer(monkeypatch: pytest.MonkeyPatch) -> list[TrainPlan]:
    """The plans handed to the trainer (a launcher's own process, not under torchrun)."""
    import stagectl.learner.loop
    import stagectl.placement

    _Trainer.seen, _Trainer.notices = [], []
    monkeypatch.setattr(stagectl.learner.loop, "Trainer", _Trainer)
    monkeypatch.setattr(stagectl.placement, "place_learner_rank", lambda launch, sides, local_rank: None)
    for name in ("STAGECTL_LAUNCHED", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return _Trainer.seen


@pytest.fixture
def rank(trainer: list[TrainPlan], monkeypatch: pytest.MonkeyPatch) -> list[TrainPlan]:
    """A learner rank torchrun started: its trainer records the plan; parsing a YAML raises."""
    import stagectl.config
    import stagectl.config.loader

    def no_yaml(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError("a rank started with a plan parsed the YAML")

    monkeypatch.setattr(stagectl.config, "load_config", no_yaml)
    monkeypatch.setattr(stagectl.config.loader, "load_config", no_yaml)
    monkeypatch.setenv("STAGECTL_LAUNCHED", "1")
    return trainer


def test_a_rank_started_with_a_plan_file_trains_that_plan_without_parsing_the_yaml(
    tmp_path: Path, rank: list[TrainPlan]
) -> None:
    plan = train_plan(load_config(ASYNC, _sets(tmp_path / "run"), world_size=2), world_size=2)
    path = write_train_plan(tmp_path / "plan.json", plan)
    # the config argument names no file: the rank must not need it
    result = CliRunner().invoke(app, ["train-ab", str(tmp_path / "gone.yaml"), "--plan", str(path)])
    assert result.exit_code == 0, result.output
    assert rank == [plan]
    assert _Trainer.notices == [None]  # its launcher says what a stop waits for, not every rank


def test_a_rank_with_a_missing_or_corrupt_plan_file_fails_in_one_line(
    tmp_path: Path, rank: list[TrainPlan]
) -> None:
    missing = CliRunner().invoke(app, ["train-ab", "cfg.yaml", "--plan", str(tmp_path / "plan.json")])
    assert missing.exit_code == 1 and rank == []
    assert "the resolved plan the launcher writes for the ranks is missing" in missing.output
    (tmp_path / "plan.json").write_text('{"model": 1}')
    corrupt = CliRunner().invoke(app, ["train-ab", "cfg.yaml", "--plan", str(tmp_path / "plan.json")])
    assert corrupt.exit_code == 1 and rank == []
    assert "not a train-ab plan this stagectl can read" in corrupt.output
    with_set = CliRunner().invoke(app, ["train-ab", "cfg.yaml", "--plan", "plan.json", "--set", "seed=1"])
    assert with_set.exit_code == 1 and "--plan" in with_set.output and rank == []


def test_the_launcher_hands_torchrun_the_plan_with_the_sets_resolved_in_it(
    tmp_path: Path, trainer: list[TrainPlan], monkeypatch: pytest.MonkeyPatch
) -> None:
    import stagectl.launch

    launched: list[tuple[list[str], TrainPlan]] = []

    def torchrun(args: list[str], launch: Any, on_signal: Any = None) -> int:
        plan_path = Path(args[args.index("--plan") + 1])
        launched.append((list(args), read_train_plan(plan_path)))  # the file is gone once the ranks are
        return 0

    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", torchrun)
    sets = _sets(tmp_path / "run")
    result = CliRunner().invoke(app, ["train-ab", str(ASYNC), *_set_args(sets)])
    assert result.exit_code == 0, result.output
    ((args, plan),) = launched
    assert args[:2] == ["train-ab", str(ASYNC)] and "--set" not in args
    assert not Path(args[args.index("--plan") + 1]).exists()  # removed after the ranks exit
    assert plan == train_plan(load_config(ASYNC, sets, world_size=2), world_size=2)
    assert plan.training.learning_rate == 0.00123 and plan.resolved.world_size == 2
    assert plan.channel_b.rollouts is not None
    assert plan.channel_b.rollouts.servers.base_urls == ("http://127.0.0.1:9",)
    assert plan.run_config["training"]["learning_rate"] == 0.00123  # what rank 0 writes to config.yaml
    assert trainer == []  # the launcher itself trains nothing


def test_one_rank_trains_the_plan_it_resolved_in_process(
    tmp_path: Path, trainer: list[TrainPlan], monkeypatch: pytest.MonkeyPatch
) -> None:
    import stagectl.launch

    def no_torchrun(args: list[str], launch: Any, on_signal: Any = None) -> NoReturn:
        raise AssertionError("a one-rank run started torchrun")

    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", no_torchrun)
    sets = [f"training.output_dir={tmp_path / 'run'}", "training.learning_rate=0.00123"]
    result = CliRunner().invoke(app, ["train-ab", str(TINY), *_set_args(sets)])
    assert result.exit_code == 0, result.output
    assert trainer == [train_plan(load_config(TINY, sets, world_size=1), world_size=1)]
    assert trainer[0].training.learning_rate == 0.00123
    assert _Trainer.notices == [STOP_NOTICE]  # the process the user started: a first Ctrl-C says so at once


@pytest.mark.parametrize("signum", [None, 15])
def test_the_end_of_a_run_names_its_b_steps_trained_as_a_also_when_a_signal_stopped_it(
    tmp_path: Path, trainer: list[TrainPlan], monkeypatch: pytest.MonkeyPatch, signum: int | None
) -> None:
    """A wanted B step that trained as Channel-A (here the first, its packs late) is in the run's log: the
    ledger line and the off-schedule warning end a finished run and a run a signal stopped (before its
    stop note, which stays the last line)."""
    from stagectl.learner.channel_b.protocol import BStepLedger

    ledger = BStepLedger()  # A, B wanted but its packs late (A), A, B
    ledger.record(False, "A", None)
    ledger.record(True, "A", "queue_empty")
    ledger.record(False, "A", None)
    ledger.record(True, "B", None)

    def stopped(self: _Trainer) -> int:
        self.stopped_by_signal = signum
        self.b_steps = ledger
        return 4

    monkeypatch.setattr(_Trainer, "run", stopped)
    sets = [f"training.output_dir={tmp_path / 'run'}"]
    result = CliRunner().invoke(app, ["train-ab", str(TINY), *_set_args(sets)])
    assert result.exit_code == (0 if signum is None else 128 + signum), result.output
    lines = result.output.splitlines()
    ledger_line = "train-ab: B steps: 2 wanted, 1 trained; 1 as Channel-A (queue_empty 1)"
    assert ledger_line in lines
    warning = [line for line in lines if line.startswith("train-ab: warning: realized b_ratio 0.25")]
    assert len(warning) == 1 and warning[0].endswith("1 as Channel-A (queue_empty 1)")
    if signum is None:
        assert "train-ab: done, 4 optimizer steps" in result.output
    else:
        assert "done," not in result.output
        assert lines[-1].startswith("stopped by SIGTERM after step 4 of 24; checkpoint saved")
        assert lines[-1].endswith(
            f"Continue with: stagectl train-ab {tmp_path / 'run' / 'config.yaml'} --resume"
        )
        assert lines.index(ledger_line) < len(lines) - 1


def test_a_second_signal_ends_with_one_line_naming_the_last_good_checkpoint(
    tmp_path: Path, trainer: list[TrainPlan], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"

    def aborted(self: _Trainer) -> int:
        (out / "checkpoint-4").mkdir(parents=True)
        (out / "checkpoint-4" / "trainer_state.json").write_text("{}")
        (out / "metrics.jsonl").write_text('{"step": 0}\n')
        self.stopped_by_signal = 2
        self.aborted_by_signal = 2
        raise KeyboardInterrupt

    monkeypatch.setattr(_Trainer, "run", aborted)
    result = CliRunner().invoke(app, ["train-ab", str(TINY), "--set", f"training.output_dir={out}"])
    assert result.exit_code == 130, result.output
    assert result.output.splitlines()[-1] == (
        f"a second SIGINT stopped the run at once, without a checkpoint: the last good checkpoint is "
        f"{out / 'checkpoint-4'}; continue with: stagectl train-ab {out / 'config.yaml'} --resume"
    )


def test_a_resume_of_a_finished_run_starts_no_rank(tmp_path: Path, trainer: list[TrainPlan]) -> None:
    import json

    out = tmp_path / "run"
    (out / "checkpoint-24").mkdir(parents=True)
    (out / "checkpoint-24" / "trainer_state.json").write_text(json.dumps({"global_step": 24}))
    (out / "metrics.jsonl").write_text('{"step": 23}\n')
    result = CliRunner().invoke(
        app, ["train-ab", str(TINY), "--resume", "--set", f"training.output_dir={out}"]
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(
        "no step is left to train (raise training.max_steps to train further); nothing was started"
    )
    assert trainer == []


@pytest.mark.parametrize(
    ("error", "recorded"),
    [
        (ValueError("cannot write checkpoint-7: no space left on device"), "cannot write checkpoint-7: no"),
        (RuntimeError("CUDA error: an illegal memory access"), "RuntimeError: CUDA error: an illegal"),
    ],
)
def test_a_run_an_error_ended_records_why_in_final_state(
    tmp_path: Path, trainer: list[TrainPlan], monkeypatch: pytest.MonkeyPatch, error: Exception, recorded: str
) -> None:
    """A run that had begun (a metrics row written) and then failed says so in final_state.json: the steps it
    completed, the error line (a bug's exception type too) and its ledger (the log prints the ledger's line);
    `stagectl report` and a refused
    restart read "failed after step 6 of 24", not a run that might still be going. A start that failed
    before its first row leaves no trace (no final_state.json either)."""
    import json

    from stagectl.rundir.ending import read_run_end

    out = tmp_path / "run"

    def failed(self: _Trainer) -> int:
        out.mkdir(exist_ok=True)
        (out / "metrics.jsonl").write_text('{"step": 0}\n')
        ledger = {"num_steps": 6, "b_steps_wanted": 3, "b_steps_trained": 2, "b_steps_as_a": {"no_server": 1}}
        self.steps_done, self.b_steps_done = 6, ledger
        raise error

    monkeypatch.setattr(_Trainer, "run", failed)
    result = CliRunner().invoke(app, ["train-ab", str(TINY), "--set", f"training.output_dir={out}"])
    assert result.exit_code != 0, result.output
    state = json.loads((out / "final_state.json").read_text())
    assert state["global_step"] == 6 and state["max_steps"] == 24 and state["error"].startswith(recorded)
    assert state["b_steps"]["b_steps_trained"] == 2
    # the log says what the finished steps trained too, as a run that ends well or by a signal does
    assert "train-ab: B steps: 3 wanted, 2 trained; 1 as Channel-A (no_server 1)" in result.output
    end = read_run_end(out)
    assert end is not None and not end.finished
    assert end.describe(why=False) == "failed after step 6 of 24"

    def failed_at_once(self: _Trainer) -> int:
        raise error

    monkeypatch.setattr(_Trainer, "run", failed_at_once)
    fresh = tmp_path / "fresh"
    CliRunner().invoke(app, ["train-ab", str(TINY), "--set", f"training.output_dir={fresh}"])
    assert not fresh.exists()


@pytest.mark.parametrize(
    ("signals", "torchrun_code", "code"), [([2], 0, 130), ([15, 15], 0, 143), ([], 0, 0), ([15], 1, 143)]
)
def test_the_launcher_exits_128_plus_the_signal_that_stopped_its_ranks(
    tmp_path: Path,
    trainer: list[TrainPlan],
    monkeypatch: pytest.MonkeyPatch,
    signals: list[int],
    torchrun_code: int,
    code: int,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The ranks exit 0 after a clean stop (torchrun would call any other code a failure); the launcher,
    which got the signal, exits 128 + it, so `train-ab && next` does not go on after a Ctrl-C. Ranks that
    were still starting (torchrun exits non-zero) said nothing: the launcher's last line says it. The first
    signal says at once what the stop waits for (once, however many signals came)."""
    import stagectl.launch

    def torchrun(args: list[str], launch: Any, on_signal: Any = None) -> int:
        for signum in signals:
            on_signal(signum)
        return torchrun_code

    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", torchrun)
    result = CliRunner().invoke(app, ["train-ab", str(ASYNC), *_set_args(_sets(tmp_path / "run"))])
    assert result.exit_code == code, result.output
    early = "train-ab: interrupted (SIGTERM) before its first step; nothing new was saved"
    assert (early in result.output.splitlines()[-1:]) == (torchrun_code != 0)
    notice = "train-ab: stopping after the current step, which is then saved (Ctrl-C again: stop now"
    assert capfd.readouterr().err.count(notice) == (1 if signals else 0)


def test_an_embedded_run_writes_the_users_config_and_runs_against_the_servers_address(
    tmp_path: Path, trainer: list[TrainPlan], monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.yaml (the plan's run_config) keeps rollout_server.embedded: true, so `train-ab
    RUN/config.yaml --resume` starts a server again; the ranks get this run's server address."""
    import contextlib

    import stagectl.launch

    launched: list[TrainPlan] = []

    @contextlib.contextmanager
    def server(*args: Any, **kwargs: Any) -> Any:
        yield "http://127.0.0.1:7"

    def torchrun(args: list[str], launch: Any, on_signal: Any = None) -> int:
        launched.append(read_train_plan(Path(args[args.index("--plan") + 1])))
        return 0

    monkeypatch.setattr(stagectl.launch, "embedded_rollout_server", server)
    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", torchrun)
    result = CliRunner().invoke(
        app, ["train-ab", str(ASYNC), "--set", f"training.output_dir={tmp_path / 'run'}"]
    )
    assert result.exit_code == 0, result.output
    ((plan,),) = [launched]
    assert plan.channel_b.rollouts is not None
    assert plan.channel_b.rollouts.servers.base_urls == ("http://127.0.0.1:7",)
    assert plan.run_config["rollout_server"]["embedded"] is True
    users = load_config(ASYNC, [f"training.output_dir={tmp_path / 'run'}"], world_size=2)
    assert plan.run_config == dict(to_plain(users))


@pytest.mark.parametrize(
    ("sync", "expected"),
    [
        ([], None),  # http: the server reads no snapshot, and was given a --weights-dir nobody had made
        (["custom.extra.rollout_matching.vllm.sync.transport=disk"], "run/weight_sync"),
        (
            [
                "custom.extra.rollout_matching.vllm.sync.transport=disk",
                "custom.extra.rollout_matching.vllm.sync.disk_dir=shm",
            ],
            "shm",  # it was always {output_dir}/weight_sync: snapshots under disk_dir were refused
        ),
    ],
)
def test_the_embedded_server_may_read_the_disk_syncs_directory_only(
    tmp_path: Path,
    trainer: list[TrainPlan],
    monkeypatch: pytest.MonkeyPatch,
    sync: list[str],
    expected: str | None,
) -> None:
    import contextlib

    import stagectl.launch

    given: list[Path | None] = []

    @contextlib.contextmanager
    def server(*args: Any, weights_dir: Path | None = None) -> Any:
        given.append(weights_dir)
        yield "http://127.0.0.1:7"

    monkeypatch.setattr(stagectl.launch, "embedded_rollout_server", server)
    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", lambda args, launch, on_signal=None: 0)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train-ab", str(ASYNC), *_set_args(["training.output_dir=run", *sync])])
    assert result.exit_code == 0, result.output
    assert given == [None if expected is None else Path(expected)]


def test_an_a_only_run_of_an_embedded_server_config_starts_no_server(
    tmp_path: Path, trainer: list[TrainPlan], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--set stage2_ab.schedule.b_ratio=0` on the AB config (an ablation's baseline) trains no B step: no
    embedded server is started (the ranks push no weights either: `channel_b.build`)."""
    import stagectl.launch

    def server(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError("an A-only run started the embedded rollout server")

    monkeypatch.setattr(stagectl.launch, "embedded_rollout_server", server)
    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", lambda args, launch, on_signal=None: 0)
    sets = [f"training.output_dir={tmp_path / 'run'}", "stage2_ab.schedule.b_ratio=0"]
    result = CliRunner().invoke(app, ["train-ab", str(ASYNC), *_set_args(sets)])
    assert result.exit_code == 0, result.output
    assert "train-ab: b_ratio 0 (A-only): the embedded rollout server is not started" in result.output


def test_a_resume_with_a_changed_config_warns_and_keeps_the_old_config(
    tmp_path: Path, trainer: list[TrainPlan]
) -> None:
    import yaml

    out = tmp_path / "run"
    first = [f"training.output_dir={out}"]
    saved = dict(to_plain(load_config(TINY, first, world_size=1)))
    saved["training"] = {**saved["training"], "overwrite_output_dir": False}
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    (out / "checkpoint-4").mkdir()
    (out / "checkpoint-4" / "trainer_state.json").write_text("{}")
    unchanged = CliRunner().invoke(app, ["train-ab", str(TINY), "--resume", *_set_args(first)])
    assert unchanged.exit_code == 0, unchanged.output
    assert "differs" not in unchanged.output and not (out / "config.step-4.yaml").exists()
    sets = [*first, "training.learning_rate=0.00123"]
    changed = CliRunner().invoke(app, ["train-ab", str(TINY), "--resume", *_set_args(sets)])
    assert changed.exit_code == 0, changed.output
    assert (
        "train-ab: warning: the resumed config differs from the one that trained checkpoint-4 (1 key): "
        in (changed.output)
    )
    assert "training.learning_rate: 0.002 -> 0.00123" in changed.output
    # the launcher writes nothing: rank 0 keeps the old config once the resume's checks passed (learner.setup)
    assert not (out / "config.step-4.yaml").exists()
    assert yaml.safe_load((out / "config.yaml").read_text()) == saved


def test_ctrl_c_before_the_first_step_says_nothing_was_saved(
    tmp_path: Path, trainer: list[TrainPlan], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(self: _Trainer, plan: TrainPlan, **kwargs: Any) -> None:
        raise KeyboardInterrupt  # Ctrl-C while the model loads

    monkeypatch.setattr(_Trainer, "__init__", interrupted)
    result = CliRunner().invoke(
        app, ["train-ab", str(TINY), "--set", f"training.output_dir={tmp_path / 'run'}"]
    )
    assert result.exit_code == 130, result.output
    assert result.output.splitlines()[-1] == INTERRUPTED_EARLY
    assert not (tmp_path / "run").exists()  # the failed start leaves nothing behind


@pytest.mark.parametrize("where", ["model load", "plan read"])
def test_a_rank_interrupted_before_its_first_step_exits_0_for_the_launcher(
    tmp_path: Path, rank: list[TrainPlan], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """torchrun would report a rank exiting 130 as failed; the launcher, which got the signal, exits 130."""
    import stagectl.config.plan_train

    def interrupted(*args: Any, **kwargs: Any) -> NoReturn:
        raise KeyboardInterrupt

    if where == "model load":
        monkeypatch.setattr(_Trainer, "__init__", interrupted)
    else:  # before the trainer's own handling: the rank's imports, reading the plan
        monkeypatch.setattr(stagectl.config.plan_train, "read_train_plan", interrupted)
    plan = train_plan(load_config(ASYNC, _sets(tmp_path / "run"), world_size=2), world_size=2)
    path = write_train_plan(tmp_path / "plan.json", plan)
    result = CliRunner().invoke(app, ["train-ab", "cfg.yaml", "--plan", str(path)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == INTERRUPTED_EARLY


def test_ctrl_c_while_the_embedded_server_starts_says_so(
    tmp_path: Path, trainer: list[TrainPlan], monkeypatch: pytest.MonkeyPatch
) -> None:
    import contextlib

    import stagectl.launch

    @contextlib.contextmanager
    def server(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(stagectl.launch, "embedded_rollout_server", server)
    result = CliRunner().invoke(
        app, ["train-ab", str(ASYNC), "--set", f"training.output_dir={tmp_path / 'run'}"]
    )
    assert result.exit_code == 130, result.output
    assert result.output.splitlines()[-1] == INTERRUPTED_EARLY
    assert trainer == []


def test_a_resume_in_another_world_size_is_refused_before_a_server_or_rank_starts(
    tmp_path: Path, trainer: list[TrainPlan], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import stagectl.launch

    def no_server(*args: Any) -> NoReturn:
        raise AssertionError("the embedded server started")

    monkeypatch.setattr(stagectl.launch, "embedded_rollout_server", no_server)
    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"data_state": {"world_size": 2}}))
    sets = [f"training.output_dir={out}", "rollout_server.embedded=true"]
    result = CliRunner().invoke(app, ["train-ab", str(ASYNC), "--resume", "--nproc", "1", *_set_args(sets)])
    assert result.exit_code == 1 and trainer == []
    assert "checkpoint-2 was written by 2 rank(s) but this run has 1" in result.output
