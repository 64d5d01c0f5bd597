"""`stagectl doctor --nproc N --world-size M` reads the world size as train-ab launches it and as
validate-config reads it (one rule, `stagectl.config.nproc_world_size`): `--nproc N` is N ranks on each of
launch.nnodes nodes, and a `--world-size` naming another world is a usage error naming both."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from stagectl.cli.app import app


def _step_mode_config(tmp_path: Path, nnodes: int) -> Path:
    """A config whose step-mode Channel-B names the world size it refuses (anything above 1)."""
    cfg = {
        "model": {"name_or_path": "builtin:tiny-qwen2.5-vl"},
        "data": {"synthetic": {"num_samples": 8, "seed": 0, "image_size": 112, "max_objects": 2}},
        "global_max_length": 512,
        "training": {"max_steps": 2, "output_dir": str(tmp_path / "run")},
        "launch": {"nnodes": nnodes, **({"rdzv_endpoint": "node0:29400"} if nnodes > 1 else {})},
        "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "step"}},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _doctor(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["doctor", *args])
    return result.exit_code, result.output


@pytest.fixture(autouse=True)
def _no_world_size_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_nproc_and_world_size_that_disagree_are_a_usage_error_naming_both(tmp_path: Path) -> None:
    # was: doctor checked the config for --world-size 3 while launch.nproc_per_node became 2, without a word
    path = _step_mode_config(tmp_path, nnodes=1)
    code, output = _doctor(str(path), "--nproc", "2", "--world-size", "3")
    assert code == 2, output
    assert (
        "--nproc 2 and --world-size 3 disagree: --nproc 2 on 1 node (launch.nnodes) is world size 2" in output
    )
    assert "config:" not in output  # refused before any check ran
    code, output = _doctor(str(path), "--nproc", "2", "--world-size", "2")
    assert code == 1 and "the world size is 2" in output  # agreeing: the config checked for that world


def test_nproc_on_several_nodes_is_that_many_ranks_per_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _step_mode_config(tmp_path, nnodes=2)
    code, output = _doctor(str(path), "--nproc", "1", "--world-size", "1")
    assert code == 2 and "--nproc 1 on 2 nodes (launch.nnodes) is world size 2; give one of them" in output
    monkeypatch.setenv("WORLD_SIZE", "1")  # --nproc describes the run, not a $WORLD_SIZE
    code, output = _doctor(str(path), "--nproc", "1", "--json")
    assert code == 1 and "the world size is 2" in output


def test_a_stale_world_size_in_the_environment_is_not_the_run_doctor_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train-ab's launcher starts launch.nproc_per_node x launch.nnodes ranks whatever `$WORLD_SIZE` its
    environment holds (one left from another job); doctor checked the config for that `$WORLD_SIZE`, so a
    one-rank step-mode config that train-ab runs failed doctor's `config` check ("the world size is 2")."""
    path = _step_mode_config(tmp_path, nnodes=1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    # a model that is not there fails fast after the config check (no weights loaded, no packed forward)
    code, output = _doctor(str(path), "--set", f"model.name_or_path={tmp_path / 'no-model'}")
    assert "OK    config:" in output and "is valid for world size 1" in output, output
    assert "the world size is 2" not in output
    assert code == 1 and "FAIL  model.load" in output  # the missing model, nothing about the world
    # --world-size still names the world to check
    code, output = _doctor(
        str(path), "--world-size", "2", "--set", f"model.name_or_path={tmp_path / 'no-model'}"
    )
    assert code == 1 and "the world size is 2" in output
