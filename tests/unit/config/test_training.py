"""`TrainingConfig.saves_checkpoint`: the steps a run writes `checkpoint-N` at (the learner's save rule,
which `stagectl doctor` counts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagectl.config.training import TrainingConfig

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny" / "train_ab.yaml"


@pytest.mark.parametrize(
    ("max_steps", "save_steps", "expected"),
    [
        (24, 12, [12, 24]),  # the last save is also a save_steps multiple: written once
        (25, 12, [12, 24, 25]),
        (24, 0, [24]),  # 0: only at the end
        (5, 10, [5]),  # save_steps beyond max_steps
        (7, 1, [1, 2, 3, 4, 5, 6, 7]),
        (10, 3, [3, 6, 9, 10]),
    ],
)
def test_saves_checkpoint_at_every_save_steps_and_the_last_step(
    max_steps: int, save_steps: int, expected: list[int]
) -> None:
    training = TrainingConfig(max_steps=max_steps, save_steps=save_steps)
    assert [step for step in range(1, max_steps + 1) if training.saves_checkpoint(step)] == expected


def test_a_home_relative_output_dir_is_the_home_directorys(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--set training.output_dir=~/runs/x` (the shell leaves `~` after `=` in an argument, and YAML never
    expands it) wrote the run into a directory named `~` in the working directory."""
    from stagectl.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(
        EXAMPLE, ["training.output_dir=~/runs/x", "training.resume_from_checkpoint=~/runs/x/checkpoint-2"]
    )
    assert cfg.training.output_dir == tmp_path / "runs" / "x"
    assert cfg.training.resume_from_checkpoint == tmp_path / "runs" / "x" / "checkpoint-2"
    assert TrainingConfig(resume_from_checkpoint="latest").resume_from_checkpoint == "latest"
    assert TrainingConfig(output_dir=Path("runs/a")).output_dir == Path("runs/a")  # relative: as given


@pytest.mark.parametrize(("value", "fix"), [("true", "write latest"), ("false", "write null")])
def test_hfs_boolean_resume_from_checkpoint_names_this_configs_spelling(value: str, fix: str) -> None:
    """`resume_from_checkpoint: true` (HF Trainer) gave pydantic's `lax-or-strict[lax=union[...]]` errors."""
    from stagectl.config import load_config

    with pytest.raises(
        ValueError, match=f"resume_from_checkpoint: {value} is the Hugging Face Trainer's spelling; {fix}"
    ) as raised:
        load_config(EXAMPLE, [f"training.resume_from_checkpoint={value}"])
    assert "lax-or-strict" not in str(raised.value)
