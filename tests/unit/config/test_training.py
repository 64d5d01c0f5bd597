"""`TrainingConfig.saves_checkpoint`: the steps a run writes `checkpoint-N` at (the learner's save rule,
which `stagectl doctor` counts)."""

from __future__ import annotations

import pytest

from stagectl.config.training import TrainingConfig


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
