"""What a user types that the config must read the way they meant: the common dtype spellings, an empty
section left behind by a deleted key."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from stagectl.cli.app import app
from stagectl.config import ConfigError, load_config

SPELLINGS = {
    "bf16": "bfloat16",
    "BF16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
}
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}


@pytest.mark.parametrize(("typed", "canonical"), SPELLINGS.items())
def test_every_dtype_key_takes_the_common_spellings(typed: str, canonical: str) -> None:
    engine = "rollout_server.vllm.dtype"
    cfg = load_config(
        None,
        [f"model.torch_dtype={typed}", f"training.mixed_precision={typed}", f"{engine}={typed}"],
    )
    assert cfg.model.torch_dtype == canonical  # stored canonical: config.yaml and the engines see one name
    assert cfg.training.mixed_precision == SHORT[canonical]
    assert cfg.rollout_server.vllm.dtype == canonical


def test_mixed_precision_no_survives_yaml_reading_it_as_false(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  mixed_precision: no\n")
    assert load_config(path).training.mixed_precision == "no"


def test_an_unknown_dtype_names_the_spellings() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.torch_dtype=bf17"])
    (problem,) = info.value.problems
    assert problem.path == "model.torch_dtype" and "bf16" in problem.message and "fp16" in problem.message


@pytest.mark.parametrize("typed", ["bf16", "half", "fp32"])
def test_export_dtype_flag_takes_the_common_spellings(tmp_path: Path, typed: str) -> None:
    result = CliRunner().invoke(
        app, ["export", str(tmp_path / "missing"), str(tmp_path / "out"), "--dtype", typed]
    )
    assert result.exit_code == 1
    assert "--dtype" not in result.output  # got past the flag: the error is about the missing checkpoint
    assert "missing" in result.output


def test_export_refuses_an_unknown_dtype_by_name(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["export", str(tmp_path / "m"), str(tmp_path / "out"), "--dtype", "bf17"]
    )
    assert result.exit_code == 1 and "--dtype: unknown dtype 'bf17'" in result.output


def test_a_section_emptied_by_deleting_b_ratio_gives_one_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    # the user deleted the only key under schedule: YAML reads `schedule:` as null
    path.write_text(
        "data: {synthetic: {num_samples: 8}}\nstage2_ab:\n  schedule:\n  channel_b: {mode: step}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.path == "stage2_ab.schedule.b_ratio" and "required" in problem.message
    assert "dictionary" not in str(info.value)


def test_a_null_optional_section_stays_absent(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("stage2_ab:\n")
    assert load_config(path).stage2_ab is None  # null means "no such section" where a section is optional
