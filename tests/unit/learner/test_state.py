"""Checkpoint atomicity and resume resolution, the LR schedule, the metrics writer."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from stagectl.config.training import TrainingConfig
from stagectl.learner import checkpoint as ckpt
from stagectl.learner.metrics import MetricsWriter
from stagectl.learner.optim import build_optimizer, lr_factor


class TinySaver(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def save_pretrained(self, path: Path, safe_serialization: bool = True) -> None:
        path.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), path / "weights.pt")


def _write(
    out: Path,
    step: int,
    model: TinySaver,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data_state: dict[str, Any],
    total_limit: int | None = None,
) -> Path:
    return ckpt.save_checkpoint(
        out,
        step,
        model=model,
        save_tokenizer=lambda path: (path / "tok.json").write_text("{}"),
        optimizer=optimizer,
        scheduler=scheduler,
        rng_states=[ckpt.rng_state()],
        trainer_state=ckpt.TrainerState(step, data_state, {"num_updates": step}),
        total_limit=total_limit,
    )


def save(
    out: Path, step: int, total_limit: int | None = None, data_state: dict[str, Any] | None = None
) -> Path:
    model = TinySaver()
    optimizer, scheduler = build_optimizer(model, TrainingConfig(max_steps=10))
    data_state = data_state or {"a_consumed": 3 * step, "b_consumed": step}
    return _write(out, step, model, optimizer, scheduler, data_state, total_limit)


def trained(out: Path, cfg: TrainingConfig, steps: int) -> tuple[TinySaver, torch.optim.Optimizer, Path]:
    """A model trained `steps` updates under `cfg`, its optimizer, and the checkpoint saved after them."""
    model = TinySaver()
    optimizer, scheduler = build_optimizer(model, cfg)
    for _ in range(steps):
        model.lin(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    path = _write(out, steps, model, optimizer, scheduler, {"a_consumed": steps, "b_consumed": 0})
    return model, optimizer, path


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    path = save(tmp_path, 4)
    assert path == tmp_path / "checkpoint-4"
    state = ckpt.load_trainer_state(path)
    assert state.global_step == 4 and state.data_state == {"a_consumed": 12, "b_consumed": 4}
    rng = ckpt.load_rng_states(path)
    ckpt.restore_rng(rng[0])
    first = torch.rand(3)
    ckpt.restore_rng(rng[0])
    assert torch.equal(first, torch.rand(3))


def test_partial_checkpoint_is_ignored_and_cleaned(tmp_path: Path) -> None:
    save(tmp_path, 2)
    torn = tmp_path / ".tmp-checkpoint-4-999"
    torn.mkdir()
    (torn / "optimizer.pt").write_bytes(b"half")
    incomplete = tmp_path / "checkpoint-6"
    incomplete.mkdir()  # no trainer_state.json: not a checkpoint
    assert ckpt.list_checkpoints(tmp_path) == [tmp_path / "checkpoint-2"]
    assert ckpt.resolve_resume("latest", tmp_path) == tmp_path / "checkpoint-2"
    save(tmp_path, 4)
    assert not torn.exists()


def test_total_limit_keeps_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save(tmp_path, step, total_limit=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]


def test_resume_errors(tmp_path: Path) -> None:
    assert ckpt.resolve_resume(None, tmp_path) is None
    assert ckpt.resolve_resume("latest", tmp_path / "empty") is None
    with pytest.raises(FileNotFoundError, match=r"resume_from_checkpoint: \S+/missing does not exist"):
        ckpt.resolve_resume(tmp_path / "missing", tmp_path)
    (tmp_path / "checkpoint-3").mkdir()  # there, but not a checkpoint
    with pytest.raises(FileNotFoundError, match="checkpoint-3 is not a complete checkpoint"):
        ckpt.resolve_resume(tmp_path / "checkpoint-3", tmp_path)


def test_a_resume_from_a_run_dir_or_a_checkpoints_model_names_the_checkpoint_meant(tmp_path: Path) -> None:
    """HF-style paths (the run's output_dir, or checkpoint-N/model) said only 'not a complete checkpoint'."""
    path = save(tmp_path / "run", 4)
    with pytest.raises(
        FileNotFoundError, match=f"it is the model/ of {path}: give that checkpoint directory"
    ):
        ckpt.resolve_resume(path / "model", tmp_path)
    with pytest.raises(FileNotFoundError, match=f"it is a run directory: give its newest checkpoint {path}"):
        ckpt.resolve_resume(tmp_path / "run", tmp_path)


def test_lr_warmup_then_cosine() -> None:
    cfg = TrainingConfig(max_steps=12, warmup_steps=2, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(s, cfg) for s in range(12)]
    assert factors[0] == pytest.approx(0.5) and factors[1] == pytest.approx(1.0)
    assert factors[2] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(factors[2:]))
    assert lr_factor(12, cfg) == pytest.approx(0.1)
    assert lr_factor(5, TrainingConfig(max_steps=12, lr_scheduler_type="constant")) == 1.0


def test_metrics_rows_and_resume_truncation(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path)
    for step in range(4):
        writer.write({"step": step, "kind": "A", "loss": float(step), "bad": float("nan")})
    writer.close()
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 4, "kin')  # torn line from a crash
    before = (tmp_path / "metrics.jsonl").read_bytes()
    MetricsWriter(tmp_path, resume_step=2).close()  # a resume that fails before its first step
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    resumed = MetricsWriter(tmp_path, resume_step=2)
    resumed.write({"step": 2, "kind": "B", "loss": 9.0})
    resumed.write({"step": 3, "kind": "A", "loss": 8.0})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # each step once: 2 and 3 replaced, not doubled
    assert rows[0]["bad"] is None and rows[2]["kind"] == "B" and rows[3]["loss"] == 8.0
    with pytest.raises(ValueError, match="refusing to truncate"):
        MetricsWriter(tmp_path)  # a new run never truncates another run's rows
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 4


def test_metrics_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    writer = MetricsWriter(tmp_path, tensorboard=True)
    writer.write({"step": 0, "kind": "A", "loss": 1.5})
    writer.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_a_resumed_runs_tensorboard_shows_each_replayed_step_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 4 and 5 ran, the run resumed from checkpoint-4: TensorBoard shows the resumed values of 4 and 5,
    not both runs' (the curve stepped back to 4), as metrics.jsonl keeps each step once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    # TensorBoard reads a run's event files in name order: `events.out.tfevents.<second>.<host>.<pid>.<n>`, n
    # counting the writers of the process. The two runs are two processes, the resumed one later. Here both
    # are this one, often within one second: with n at 9 and 10 (writers earlier in the test session) "10"
    # sorted first and the old run's steps 4 and 5 came back (the intermittent failure of this test). n starts
    # at 0, as in a new process.
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(0))
    writer = MetricsWriter(tmp_path, tensorboard=True)
    for step in range(6):
        writer.write({"step": step, "kind": "A", "loss": float(step)})
    writer.close()
    resumed = MetricsWriter(tmp_path, tensorboard=True, resume_step=4)
    for step in range(4, 7):
        resumed.write({"step": step, "kind": "A", "loss": 100.0 + step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 104.0), (5, 105.0), (6, 106.0)]


@pytest.mark.parametrize("warmup_steps", [0, 2])
def test_resuming_with_more_steps_trains_its_first_step_at_the_new_schedule(
    tmp_path: Path, warmup_steps: int
) -> None:
    """A cosine that reached 0 at max_steps 4, resumed with max_steps 8: the first resumed step (4) runs at
    the new schedule's lr for step 4, not at the 0 the optimizer saved (its parameters move)."""
    first_cfg = TrainingConfig(max_steps=4, warmup_steps=warmup_steps, learning_rate=1e-3)
    model, optimizer, path = trained(tmp_path, first_cfg, 4)
    assert optimizer.param_groups[0]["lr"] == 0.0  # the end of the first run's cosine
    resumed_cfg = TrainingConfig(max_steps=8, warmup_steps=warmup_steps, learning_rate=1e-3)
    optimizer, scheduler = build_optimizer(model, resumed_cfg)
    ckpt.load_optimizer_state(path, model, optimizer, scheduler)
    expected = 1e-3 * lr_factor(4, resumed_cfg)
    assert expected > 0
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    assert scheduler.get_last_lr() == pytest.approx([expected])
    before = model.lin.weight.detach().clone()
    model.lin(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert not torch.equal(model.lin.weight, before)
    scheduler.step()  # and the schedule goes on from there: step 5 of 8
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_factor(5, resumed_cfg))


def test_a_resume_with_another_learning_rate_trains_at_it(tmp_path: Path) -> None:
    """The resumed config's learning_rate is the peak of the schedule from the resumed step on (the scheduler
    state kept the checkpoint's: config.yaml said 5e-4 and the run went on at 1e-3)."""
    first_cfg = TrainingConfig(max_steps=8, learning_rate=1e-3, lr_scheduler_type="linear")
    model, optimizer, path = trained(tmp_path, first_cfg, 4)
    resumed_cfg = TrainingConfig(max_steps=8, learning_rate=5e-4, lr_scheduler_type="linear")
    optimizer, scheduler = build_optimizer(model, resumed_cfg)
    ckpt.load_optimizer_state(path, model, optimizer, scheduler)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-4 * lr_factor(4, resumed_cfg))
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-4 * lr_factor(5, resumed_cfg))
    assert scheduler.get_last_lr() == pytest.approx([5e-4 * lr_factor(5, resumed_cfg)])


def test_a_resume_with_other_adamw_settings_trains_with_them(tmp_path: Path) -> None:
    """weight_decay and adam_betas changed on resume were silently the checkpoint's (loading the optimizer
    state restores its param groups), while the resume warning and config.yaml named the new values."""
    first_cfg = TrainingConfig(max_steps=8, learning_rate=1e-3, weight_decay=0.0, adam_betas=(0.9, 0.999))
    model, optimizer, path = trained(tmp_path, first_cfg, 1)
    resumed_cfg = TrainingConfig(max_steps=8, learning_rate=1e-3, weight_decay=0.1, adam_betas=(0.9, 0.95))
    optimizer, scheduler = build_optimizer(model, resumed_cfg)
    ckpt.load_optimizer_state(path, model, optimizer, scheduler)
    group = optimizer.param_groups[0]
    assert (group["weight_decay"], tuple(group["betas"])) == (0.1, (0.9, 0.95))
    assert optimizer.state[group["params"][0]]["step"] == 1  # the moments are the checkpoint's


def test_a_resume_on_a_training_set_of_another_size_is_refused_naming_both_sizes(tmp_path: Path) -> None:
    """The stream positions index the set the checkpoint trained on: a shrunk set failed on a missing
    index (IndexError) deep in the learner's start-up; now rank 0's resume check names both sizes."""
    from stagectl.dist import SharedError, World
    from stagectl.learner.setup import shared_resume

    data_state = {"world_size": 1, "num_train_samples": 32, "ranks": [{"a_consumed": 4, "b_consumed": 2}]}
    path = save(tmp_path, 4, data_state=data_state)
    training = TrainingConfig(max_steps=10, output_dir=str(tmp_path), resume_from_checkpoint="latest")
    world = World(rank=0, local_rank=0, world_size=1)
    assert shared_resume(training, world, 32) == (path, {"a_consumed": 4, "b_consumed": 2})
    with pytest.raises(
        SharedError, match=r"checkpoint-4 was written on a training set of 32 samples but .* now has 8"
    ):
        shared_resume(training, world, 8)


def test_a_damaged_checkpoint_file_is_one_error_naming_the_part_and_the_earlier_checkpoint(
    tmp_path: Path,
) -> None:
    from stagectl.dist import CollectiveError

    save(tmp_path, 2)
    path = save(tmp_path, 4)
    (path / "optimizer.pt").write_bytes((path / "optimizer.pt").read_bytes()[:100])  # cut off
    model = TinySaver()
    optimizer, scheduler = build_optimizer(model, TrainingConfig(max_steps=10))
    with pytest.raises(ValueError) as info, ckpt.reading(path, "optimizer state"):
        ckpt.load_optimizer_state(path, model, optimizer, scheduler)
    assert str(info.value).startswith(
        f"training.resume_from_checkpoint: {path}: its optimizer state cannot be loaded (RuntimeError: "
    )
    assert str(info.value).endswith(
        f"resume from an earlier one (--set training.resume_from_checkpoint={tmp_path / 'checkpoint-2'}) "
        "or move checkpoint-4 aside"
    )
    with pytest.raises(
        ValueError, match=r"its rng\.pt cannot be loaded .*move checkpoint-2 aside to start again"
    ):
        (tmp_path / "checkpoint-2" / "rng.pt").write_bytes(b"")
        with ckpt.reading(tmp_path / "checkpoint-2", "rng.pt"):
            ckpt.load_rng_states(tmp_path / "checkpoint-2")
    with pytest.raises(CollectiveError), ckpt.reading(path, "optimizer state"):  # not the file's fault
        raise CollectiveError("rank 1 did not join")
