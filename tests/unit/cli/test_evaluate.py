"""`stagectl eval`'s command: the rules it applies to its config (not the training-world ones) and the model it
picks from --model."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from stagectl.cli.app import app

LEARN_SHAPES = Path(__file__).parents[3] / "examples" / "tiny" / "learn_shapes.yaml"
COCO_CONFIG = Path(__file__).parents[3] / "examples" / "coco" / "train_ab.yaml"


def test_nproc_2_is_not_refused_by_the_training_only_channel_b_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The COCO config trains Channel-B in step mode (one learner rank); eval's ranks only shard images, so
    `--nproc 2` relaunches under torchrun instead of failing `stage2_ab.channel_b.mode`."""
    from stagectl import launch

    launched: list[tuple[list[str], int]] = []

    def relaunch(args: list[str], cfg: launch.LaunchConfig, **_: object) -> int:
        launched.append((list(args), cfg.nproc_per_node))
        return 0

    monkeypatch.setattr(launch, "relaunch_under_torchrun", relaunch)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["eval", str(COCO_CONFIG), "--out", str(out), "--nproc", "2"])
    assert result.exit_code == 0, result.output
    assert [n for _, n in launched] == [2] and "launch.nproc_per_node=2" in launched[0][0]


def test_the_ranks_load_the_config_the_launcher_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside torchrun `$WORLD_SIZE` is 2: the training-world rules still do not apply to eval."""
    from stagectl.config import ConfigError, load_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"stage2_ab\.channel_b\.mode"):
        load_config(COCO_CONFIG)  # training reads it this way
    cfg = load_config(COCO_CONFIG, ["launch.nproc_per_node=2"], trains=False)
    assert cfg.launch.nproc_per_node == 2


def test_a_fsdp_training_config_evaluates_on_one_process() -> None:
    """fsdp needs 2+ learner ranks to train; eval on one process does not shard parameters."""
    from stagectl.config import ConfigError, load_config

    fsdp = Path(__file__).parents[3] / "examples" / "tiny" / "train_ab_fsdp.yaml"
    with pytest.raises(ConfigError, match=r"training\.parallelism"):
        load_config(fsdp, ["launch.nproc_per_node=1"], world_size=1)
    assert load_config(fsdp, ["launch.nproc_per_node=1"], trains=False).training.parallelism == "fsdp"


def test_model_a_run_dir_evaluates_its_newest_checkpoint_and_says_which(tmp_path: Path) -> None:
    """`--model RUN_DIR` reads as `stagectl export` reads it (it failed with `no config.json`); here the
    picked checkpoint's model is not loadable, so the eval stops right after naming it."""
    from stagectl.models.loading import TRAINER_STATE

    run = tmp_path / "run"
    for step in (6, 12):
        model = run / f"checkpoint-{step}" / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text('{"model_type": "not-a-model"}')
        (model.parent / TRAINER_STATE).write_text("{}")
    result = CliRunner().invoke(
        app,
        ["eval", str(LEARN_SHAPES), "--model", str(run), "--out", str(tmp_path / "out"), "--gallery", "0"],
    )
    picked = run / "checkpoint-12" / "model"
    assert f"evaluating its newest checkpoint, checkpoint-12 ({picked})" in result.output
    assert result.exit_code == 1 and f"{picked}: transformers" in result.output


def test_a_ctrl_c_says_what_the_eval_left_behind(tmp_path: Path) -> None:
    from stagectl.cli.evaluate import interrupted_line

    out = tmp_path / "eval"
    assert interrupted_line(out).startswith(f"eval: interrupted (SIGINT); nothing was written to {out}")
    out.mkdir()
    (out / "predictions.coco.json").write_text("[]")
    assert "holds predictions.coco.json but no metrics.json" in interrupted_line(out)
    (out / "metrics.json").write_text("{}")
    assert "after its results were written" in interrupted_line(out)


def test_a_ctrl_c_during_the_eval_ends_with_that_line_and_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stagectl.cli.evaluate as evaluate

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "_evaluate", interrupted)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "data: {synthetic: {num_samples: 2}, eval: {synthetic: {num_samples: 2, seed: 1}}}\n"
        "stage2_ab: {schedule: {b_ratio: 0.0}}\n"
    )
    result = CliRunner().invoke(app, ["eval", str(config), "--out", str(tmp_path / "eval")])
    assert result.exit_code == 130
    assert "eval: interrupted (SIGINT); nothing was written to" in result.output


def test_a_chat_template_that_does_not_compile_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was rendered by the first generate, after the model had loaded, and the eval ended on a
    traceback; it is named (file and line) before any weight loads now."""
    import stagectl.models.loading

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model loaded; the eval should have refused its chat template first")

    monkeypatch.setattr(stagectl.models.loading, "load_bundle", no_load)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2_5_vl", "vision_config": {}}')
    (model / "chat_template.jinja").write_text("{% if %}")
    result = CliRunner().invoke(
        app,
        ["eval", str(LEARN_SHAPES), "--model", str(model), "--out", str(tmp_path / "out"), "--gallery", "0"],
    )
    assert result.exit_code == 1, result.output
    assert (
        f"error: --model / model.name_or_path: {model / 'chat_template.jinja'}: the chat template does not "
        "compile (line 1)"
    ) in result.output


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("notaurl", "is not an http:// or https:// URL with a host"),
        ("ftp://h:8000", "is not an http:// or https:// URL with a host"),
        ("http://h:99999", "is not a URL (Port out of range 0-65535)"),
        ("http://h:8000/infer/", "names an endpoint ('/infer/'); the client adds the endpoints itself"),
    ],
)
def test_a_server_url_no_request_can_reach_is_refused_before_any_model_or_data_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, why: str
) -> None:
    """`--server notaurl` (or ftp://, a port out of range, a pasted endpoint) loaded the tokenizer and the data,
    then waited `vllm.server.timeout_s` (120 s) for its `/health/`; `http://[::1` was a traceback. The check
    the config's server keys get (`check_server_url`) now refuses it first, naming the flag."""
    import stagectl.evaluation.session

    def no_eval(*args: object, **kwargs: object) -> None:
        raise AssertionError("the eval started; --server should have been refused first")

    monkeypatch.setattr(stagectl.evaluation.session, "run_eval", no_eval)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["eval", str(LEARN_SHAPES), "--server", url, "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert f"error: --server: {url!r} {why}" in result.output
    assert not out.exists()


def test_one_process_is_the_only_rank_whatever_world_size_its_environment_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eval on one process read its world from a `$WORLD_SIZE` left in the environment by another job and
    failed in torch.distributed's rendezvous ("environment variable RANK expected, but not set")."""
    import stagectl.cli.evaluate
    from stagectl import dist

    seen: list[dist.World] = []
    monkeypatch.setattr(stagectl.cli.evaluate, "_evaluate", lambda *_: seen.append(dist.read_world()))
    for name in ("STAGECTL_LAUNCHED", "TORCHELASTIC_RUN_ID", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = CliRunner().invoke(
        app, ["eval", str(LEARN_SHAPES), "--out", str(tmp_path / "out"), "--gallery", "0"]
    )
    assert result.exit_code == 0, result.output
    assert seen == [dist.World(rank=0, local_rank=0, world_size=1)]
