"""A train-ab start refused before it writes anything: a model train-ab cannot train (a text-only
checkpoint) fails in the launcher, before the run directory, a server or a weight load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import pytest
from typer.testing import CliRunner

from stagectl.cli.app import app

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples/tiny/train_ab.yaml"
ASYNC = ROOT / "examples/tiny/train_ab_async.yaml"


def test_a_text_only_model_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stagectl.cli.train_ab  # light: the trainer (torch) is imported only when a run trains

    def no_training(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError("the run started (and would load the model) for a text-only model")

    monkeypatch.setattr(stagectl.cli.train_ab, "_train", no_training)
    for name in ("STAGECTL_LAUNCHED", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    text_only = tmp_path / "qwen3"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    out = tmp_path / "runs" / "x"
    sets = [f"model.name_or_path={text_only}", f"training.output_dir={out}"]
    result = CliRunner().invoke(app, ["train-ab", str(TINY), *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 1, result.output
    assert (
        f"error: model.name_or_path: {text_only} is a text-only qwen3 model (config.json has no "
        "vision_config): train-ab trains detection on images and needs a Qwen-VL model"
    ) in result.output
    assert not (tmp_path / "runs").exists()


SERVER_ROLLOUTS = [
    "custom.extra.rollout_matching.rollout_backend=vllm",
    "custom.extra.rollout_matching.vllm.mode=server",
]
EMBEDDED = ["rollout_server.embedded=true", *SERVER_ROLLOUTS]


def _refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch, sets: list[str], server: list[str] = EMBEDDED
) -> str:
    """train-ab's output for `sets` on the tiny example with server rollouts (an embedded server unless
    `server` says otherwise), asserting that it exits 1 before a server starts or a rank loads the model
    (both are replaced by a failure)."""
    import stagectl.cli.train_ab
    import stagectl.launch

    def started(what: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> NoReturn:
            raise AssertionError(f"{what} started; the launcher should have refused the config")

        return refuse

    monkeypatch.setattr(stagectl.cli.train_ab, "_train", started("the run (a model load)"))
    monkeypatch.setattr(stagectl.launch, "embedded_rollout_server", started("the embedded rollout server"))
    for name in ("STAGECTL_LAUNCHED", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(
        app, ["train-ab", str(TINY), *[a for s in [*server, *sets] for a in ("--set", s)]]
    )
    assert result.exit_code == 1, result.output
    return result.output


def test_a_held_out_split_that_cannot_be_read_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """data.eval.jsonl was first read by rank 0's evaluator, after the embedded server and the model had
    loaded (minutes on a real model); a missing file, a bad line or a missing image now fails at once."""
    out = tmp_path / "runs" / "x"
    split = tmp_path / "eval.jsonl"
    line = {
        "images": ["gone.png"],
        "width": 112,
        "height": 112,
        "objects": [{"desc": "a", "bbox_2d": [1, 1, 5, 5]}],
    }
    split.write_text(json.dumps(line) + "\n")
    for jsonl, said in (
        (tmp_path / "missing.jsonl", f"{tmp_path / 'missing.jsonl'}: no such file"),
        (split, f"{split}:1: image not found: {tmp_path / 'gone.png'}"),
    ):
        output = _refused_before_the_run(
            monkeypatch, [f"data.eval.jsonl={jsonl}", f"training.output_dir={out}"]
        )
        assert f"error: data.eval.jsonl: {said}" in output
    assert not (tmp_path / "runs").exists()


def test_a_resume_from_a_checkpoint_that_is_not_there_is_refused_before_the_server_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume_from_checkpoint path that does not exist (or is no complete checkpoint) was refused by the
    ranks, after the embedded server had loaded its model, leaving the server's log in the run dir."""
    out = tmp_path / "runs" / "x"
    missing = tmp_path / "checkpoint-7"
    output = _refused_before_the_run(
        monkeypatch, [f"training.resume_from_checkpoint={missing}", f"training.output_dir={out}"]
    )
    assert f"error: training.resume_from_checkpoint: {missing} does not exist" in output
    missing.mkdir()  # there, without its trainer_state.json
    output = _refused_before_the_run(
        monkeypatch, [f"training.resume_from_checkpoint={missing}", f"training.output_dir={out}"]
    )
    assert f"error: training.resume_from_checkpoint: {missing} is not a complete checkpoint" in output
    assert not (tmp_path / "runs").exists()


def test_a_missing_token_or_ca_file_of_listed_servers_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout client reads its token's variable and an https server's CA file when a rank builds it,
    after the model has loaded; the launcher now reads both first."""
    key = "custom.extra.rollout_matching.vllm.server"
    monkeypatch.delenv("FAILLATE_UNSET_TOKEN", raising=False)
    listed = [*SERVER_ROLLOUTS, f"{key}.servers=[{{base_url: 'https://127.0.0.1:1'}}]"]
    sets = [f"training.output_dir={tmp_path / 'runs' / 'x'}"]
    output = _refused_before_the_run(
        monkeypatch, [*sets, f"{key}.auth_token_env=FAILLATE_UNSET_TOKEN"], listed
    )
    assert f"error: {key}.auth_token_env names $FAILLATE_UNSET_TOKEN, which is unset or empty" in output
    missing = tmp_path / "ca.pem"
    output = _refused_before_the_run(monkeypatch, [*sets, f"{key}.tls_ca_file={missing}"], listed)
    assert f"error: {key}.tls_ca_file: cannot load {missing}" in output
    assert not (tmp_path / "runs").exists()


def test_a_listed_server_that_does_not_answer_is_named_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks wait for a server still starting (by design), but they first said so after the model had
    loaded; the launcher now names a server that does not answer /health/ and the wait ahead, and starts
    the run as before."""
    import socket

    import stagectl.cli.train_ab

    with socket.socket() as sock:  # a port nobody listens on: its connection is refused
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    started: list[object] = []
    monkeypatch.setattr(stagectl.cli.train_ab, "_train", started.append)
    for name in ("STAGECTL_LAUNCHED", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    key = "custom.extra.rollout_matching.vllm.server"
    sets = [
        *SERVER_ROLLOUTS,
        f"{key}.servers=[{{base_url: '{url}'}}]",
        f"training.output_dir={tmp_path / 'run'}",
    ]
    result = CliRunner().invoke(app, ["train-ab", str(TINY), *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 0, result.output
    assert len(started) == 1  # a note, not a refusal: the server may still be starting
    assert (
        f"train-ab: note: not answering /health/ now: {url} (ConnectError: " in result.output
        and f"once the model has loaded the ranks wait up to 120 s ({key}.timeout_s) for it" in result.output
    )


def test_a_resume_on_a_training_set_of_another_size_is_refused_before_the_server_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks refused it (their stream positions index the old set), but only after the embedded server
    had loaded its model; the launcher now compares the set's size with the checkpoint's first."""
    from tests.unit.rundir.runs import finished_run

    out = tmp_path / "run"
    finished_run(out, num_rows=2, checkpoints=(2,))
    state = {"global_step": 2, "data_state": {"world_size": 1, "num_train_samples": 255}}
    (out / "checkpoint-2" / "trainer_state.json").write_text(json.dumps(state))
    before = sorted(p.name for p in out.iterdir())
    output = _refused_before_the_run(
        monkeypatch, [f"training.output_dir={out}", "training.resume_from_checkpoint=latest"]
    )
    assert (
        "error: training.resume_from_checkpoint: checkpoint-2 was written on a training set of 255 samples "
        "but the data (data.train_jsonl / data.synthetic) now has 256"
    ) in output
    assert sorted(p.name for p in out.iterdir()) == before


def test_a_held_out_split_that_sets_both_jsonl_and_synthetic_is_refused_at_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """data.eval with both `synthetic` and `jsonl`: the evaluator would read the synthetic split and ignore
    the jsonl without a word (the launcher then refused the run over a jsonl nobody reads). One of them is
    asked for, as data.train_jsonl / data.synthetic are, before anything starts or is written."""
    out = tmp_path / "runs" / "x"
    sets = [
        f"data.eval.jsonl={tmp_path / 'missing.jsonl'}",
        "data.eval.synthetic={num_samples: 4, seed: 1, image_size: 112}",
        f"training.output_dir={out}",
    ]
    output = _refused_before_the_run(monkeypatch, sets)
    assert "data.eval: set one of data.eval.jsonl or data.eval.synthetic, not both" in output
    assert not out.exists()


def test_nproc_on_several_nodes_is_validated_for_the_ranks_the_plan_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train-ab --nproc 2 on a two-node config (launch.nnodes: 2) validated the config for world size 2 while
    it resolved its plan, and torchrun started, for 4 ranks: effective_batch_size 2 passed and the run
    trained 4 rows a step. The launcher now validates for the world size its plan has, and a $WORLD_SIZE in
    its own environment changes neither, with --nproc or without (launch.nproc_per_node)."""
    import stagectl.launch
    from stagectl.config.plan_train import TrainPlan, read_train_plan

    launched: list[TrainPlan] = []

    def torchrun(args: list[str], launch: Any, on_signal: Any = None) -> int:
        launched.append(read_train_plan(Path(args[args.index("--plan") + 1])))
        return 0

    monkeypatch.setattr(stagectl.launch, "relaunch_under_torchrun", torchrun)
    for name in ("STAGECTL_LAUNCHED", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    sets = [
        "launch.nnodes=2",
        "launch.rdzv_endpoint=node0:29400",
        "training.gradient_accumulation_steps=null",
        f"training.output_dir={tmp_path / 'run'}",
        "rollout_server.embedded=false",
        "custom.extra.rollout_matching.vllm.server.servers=[{base_url: 'http://127.0.0.1:9'}]",
    ]

    def train_ab(effective_batch_size: int, nproc: tuple[str, ...] = ("--nproc", "2")) -> Any:
        batch = [f"training.effective_batch_size={effective_batch_size}"]
        args = [a for s in [*sets, *batch] for a in ("--set", s)]
        return CliRunner().invoke(app, ["train-ab", str(ASYNC), *nproc, *args])

    refused = train_ab(2)
    assert refused.exit_code == 1, refused.output
    assert (
        "training.effective_batch_size: 2 is not a multiple of per_device_train_batch_size x world_size "
        "(1 x 4 = 4)"
    ) in refused.output
    assert launched == []
    monkeypatch.setenv("WORLD_SIZE", "2")  # a stale one in the launcher's environment: --nproc says the run
    started = train_ab(4)
    assert started.exit_code == 0, started.output
    (plan,) = launched
    assert plan.resolved.world_size == 4 and plan.resolved.gradient_accumulation_steps == 1
    # without --nproc the launch section says the run (2 x 2), not a stale $WORLD_SIZE of 3
    monkeypatch.setenv("WORLD_SIZE", "3")
    launched.clear()
    started = train_ab(4, nproc=("--set", "launch.nproc_per_node=2"))
    assert started.exit_code == 0, started.output
    (plan,) = launched
    assert plan.resolved.world_size == 4 and plan.resolved.gradient_accumulation_steps == 1


def test_a_one_rank_run_is_one_rank_whatever_world_size_its_environment_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher plans a one-rank config for one rank and trains it in its own process; that process read
    its world from a `$WORLD_SIZE` / `$RANK` left in the environment by another job, so the run failed at
    start ("the plan was resolved for 1 learner rank(s) but this run has 2"). The rank is the only one."""
    import stagectl.cli.train_ab
    from stagectl import dist

    seen: list[dist.World] = []

    def train(plan: Any) -> None:
        assert plan.resolved.world_size == 1
        seen.append(dist.read_world())

    monkeypatch.setattr(stagectl.cli.train_ab, "_train", train)
    for name in ("STAGECTL_LAUNCHED", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train-ab", str(TINY), "--set", f"training.output_dir={out}"])
    assert result.exit_code == 0, result.output
    assert seen == [dist.World(rank=0, local_rank=0, world_size=1)]
