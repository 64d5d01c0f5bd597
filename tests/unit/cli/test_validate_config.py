"""`stagectl validate-config --for COMMAND`: a config it passes is one that command accepts (train-ab by
default); `--nproc` reads as train-ab's. In process (the subprocess tests of the command are in test_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stagectl.cli.app import app

EXAMPLES = Path(__file__).parents[3] / "examples" / "tiny"


def validate(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["validate-config", *args])
    return result.exit_code, result.output


def test_an_empty_config_is_refused_as_train_ab_refuses_it(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    code, output = validate(str(empty))
    assert code == 1
    assert f"error: {empty}: train-ab needs a stage2_ab section (stage2_ab.schedule.b_ratio)" in output
    assert "--for eval, stage-b or rollout-server" in output  # it may be another command's config


@pytest.mark.parametrize(
    ("example", "command"),
    [
        ("train_ab.yaml", "train-ab"),
        ("stage_b.yaml", "stage-b"),
        ("rollout_server.yaml", "rollout-server"),
        ("learn_shapes.yaml", "eval"),
    ],
)
def test_each_example_validates_for_its_command(example: str, command: str) -> None:
    code, output = validate(str(EXAMPLES / example), "--for", command, "--format", "json")
    assert code == 0, output
    assert json.loads(output)["model"]["name_or_path"].startswith("builtin:")


@pytest.mark.parametrize(
    ("example", "command", "message"),
    [
        ("stage_b.yaml", "train-ab", "train-ab needs a stage2_ab section"),
        ("train_ab.yaml", "stage-b", "not a Stage-B config; set mission, tickets and guidance.path"),
        ("train_ab.yaml", "eval", "nothing to evaluate (no data.eval)"),
    ],
)
def test_a_config_for_another_command_is_refused_with_that_commands_words(
    example: str, command: str, message: str
) -> None:
    code, output = validate(str(EXAMPLES / example), "--for", command)
    assert code == 1 and message in output


def test_the_fix_for_a_config_with_nothing_to_evaluate_is_one_validate_config_takes() -> None:
    """`validate-config train_ab.yaml --for eval` said "give --data JSONL or set data.eval"; validate-config has
    no --data (No such option). The advice names the --set both commands take, and following it passes."""
    code, output = validate(str(EXAMPLES / "train_ab.yaml"), "--for", "eval")
    assert code == 1 and "--set data.eval.jsonl=JSONL" in output
    code, output = validate(
        str(EXAMPLES / "train_ab.yaml"), "--for", "eval", "--set", "data.eval.jsonl=x.jsonl"
    )
    assert code == 0, output


def test_nproc_reads_as_train_abs() -> None:
    code, output = validate(str(EXAMPLES / "train_ab.yaml"), "--nproc", "2")
    assert code == 1  # train-ab --nproc 2 refuses step-mode Channel-B on 2 ranks
    assert "'step' runs Channel-B on one learner rank only, but the world size is 2" in output
    code, output = validate(str(EXAMPLES / "train_ab_async.yaml"), "--nproc", "3", "--format", "json")
    assert code == 0, output
    assert json.loads(output)["launch"]["nproc_per_node"] == 3


def test_a_stale_world_size_in_the_environment_is_not_the_world_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """train-ab's launcher starts launch.nproc_per_node x launch.nnodes ranks whatever `$WORLD_SIZE` its
    environment holds (one left from another job); validate-config checked the config for that `$WORLD_SIZE`,
    so the one-rank step-mode example that train-ab runs was refused ("the world size is 2")."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, output = validate(str(EXAMPLES / "train_ab.yaml"))
    assert code == 0, output
    code, output = validate(str(EXAMPLES / "train_ab.yaml"), "--world-size", "2")  # still names the world
    assert code == 1 and "but the world size is 2" in output


def test_eval_is_checked_as_eval_loads_its_config() -> None:
    code, output = validate(str(EXAMPLES / "learn_shapes.yaml"), "--nproc", "2")
    assert code == 1 and "but the world size is 2" in output  # train-ab's rule for 2 learner ranks
    code, output = validate(str(EXAMPLES / "learn_shapes.yaml"), "--for", "eval", "--nproc", "2")
    assert code == 0, output  # eval's ranks shard images: no training-world rule


def test_an_unknown_command_is_a_usage_error() -> None:
    code, output = validate(str(EXAMPLES / "train_ab.yaml"), "--for", "train")
    assert code == 2 and "--for must be one of train-ab, eval, stage-b, rollout-server, got 'train'" in output


def test_nproc_and_world_size_that_disagree_are_a_usage_error_naming_both() -> None:
    # was: the config was validated for --world-size 3 while launch.nproc_per_node became 2, without a word
    code, output = validate(str(EXAMPLES / "train_ab_async.yaml"), "--nproc", "2", "--world-size", "3")
    assert code == 2
    assert (
        "--nproc 2 and --world-size 3 disagree: --nproc 2 on 1 node (launch.nnodes) is world size 2" in output
    )
    code, output = validate(str(EXAMPLES / "train_ab_async.yaml"), "--nproc", "2", "--world-size", "2")
    assert code == 0, output


def test_nproc_on_several_nodes_is_that_many_ranks_per_node() -> None:
    # two nodes of --nproc 2: world size 4 (step-mode Channel-B names the world size it refuses)
    nodes = ("--set", "launch.nnodes=2", "--set", "launch.rdzv_endpoint=node0:29400")
    args = (str(EXAMPLES / "train_ab.yaml"), *nodes, "--nproc", "2")
    code, output = validate(*args)
    assert code == 1 and "but the world size is 4" in output
    code, output = validate(
        str(EXAMPLES / "train_ab_async.yaml"), *nodes, "--nproc", "2", "--world-size", "4"
    )
    assert code == 0, output
    code, output = validate(*args, "--world-size", "2")
    assert code == 2 and "--nproc 2 on 2 nodes (launch.nnodes) is world size 4; give one of them" in output
