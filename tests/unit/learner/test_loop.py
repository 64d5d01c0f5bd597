"""`Trainer._row`: two ranks' loss terms, token and pack counters and update-probe counts reduced once, each
by the reduction the metric catalog declares, and the ratios computed from the reduced values (the gather of
`dist.reduce_metrics` plays the second rank)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from stagectl import dist
from stagectl.learner.packs import StepAccumulator
from stagectl.timing import PhaseTimer


def _trainer() -> Any:
    from stagectl.learner.loop import Trainer

    trainer: Any = object.__new__(Trainer)  # only what `_row` reads is set
    trainer.state = SimpleNamespace(scheduler=SimpleNamespace(get_last_lr=lambda: [1e-4]))
    trainer.runner = SimpleNamespace(packing_length=100, timer=PhaseTimer())
    trainer.gas, trainer.num_updates = 2, 3
    return trainer


def _acc(loss: float, tokens: int, capacity: int, fill: float) -> StepAccumulator:
    lengths = [tokens // 2, tokens - tokens // 2]
    return StepAccumulator(
        terms={"loss": loss, "loss/ce": loss / 2},
        num_packs=2,
        num_segments=2,
        num_tokens=tokens,
        segment_lengths=lengths,
        capacity_tokens=capacity,
        num_backward=2,
        min_fill=fill,
    )


def _row(trainer: Any, acc: StepAccumulator, update_counts: tuple[int, int]) -> dict[str, Any]:
    return trainer._row(3, "A", False, acc, update_counts, {}, grad_norm=0.5, step_s=2.0)  # type: ignore[no-any-return]


def test_two_ranks_row_is_reduced_by_the_catalog(monkeypatch: pytest.MonkeyPatch) -> None:
    handed_in: list[Any] = []
    monkeypatch.setattr(dist, "all_gather_objects", lambda local: handed_in.append(local) or [local])
    _row(_trainer(), _acc(loss=3.0, tokens=60, capacity=200, fill=0.2), (30, 100))
    rank1 = handed_in.pop()
    monkeypatch.setattr(dist, "all_gather_objects", lambda local: [local, rank1])
    row = _row(_trainer(), _acc(loss=1.0, tokens=140, capacity=200, fill=0.6), (10, 100))
    assert {k: row[k] for k in ("loss", "loss/ce", "tokens", "grad_norm", "num_backward")} == {
        "loss": 2.0,  # mean
        "loss/ce": 1.0,
        "tokens": 200,  # sum
        "grad_norm": 0.5,  # rank 0's
        "num_backward": 2,
    }
    assert {k: v for k, v in row.items() if k.startswith("packing/")} == {
        "packing/fill": 0.5,  # 200 tokens / 400 capacity
        "packing/fill_min": 0.2,  # the emptiest pack of any rank
        "packing/tokens_per_forward": 50.0,  # 200 tokens / 4 packs
        "packing/n_packs": 4,
        "packing/lower_bound": 3,  # each rank's own bound, summed: 1 (60 tokens) + 2 (two of 70 > 100/2)
        "packing/n_segments": 4,
    }
    assert row["optim/update_nonzero_frac"] == 0.2  # (30 + 10) / (100 + 100)
    assert "packing/capacity_tokens" not in row and "optim/update_changed" not in row  # inputs, not keys


def test_a_b_row_reports_its_pack_fill_under_packing_b_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    """A B step's row carries `packing/b_fill` (its packs' fill, the value of `packing/fill`); an A step's
    row does not, so the B fill is read without a row filter (`stagectl report` summarises it)."""
    monkeypatch.setattr(dist, "all_gather_objects", lambda local: [local])
    acc = _acc(loss=1.0, tokens=180, capacity=200, fill=0.85)
    row = _trainer()._row(5, "B", True, acc, (1, 2), {}, grad_norm=0.5, step_s=2.0)
    assert row["packing/b_fill"] == row["packing/fill"] == 0.9
    assert "packing/b_fill" not in _row(_trainer(), _acc(loss=1.0, tokens=60, capacity=200, fill=0.2), (1, 2))


def test_the_sync_share_of_the_step_is_logged_on_steps_that_synced_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`weight_sync/step_fraction` is a "syncs" metric: the timer's `time/weight_sync_s` is 0.0 on a step
    without a sync, which wrote 0.0 into every row."""
    monkeypatch.setattr(dist, "all_gather_objects", lambda local: [local])
    trainer = _trainer()
    acc = _acc(loss=1.0, tokens=60, capacity=200, fill=0.2)
    assert "weight_sync/step_fraction" not in _row(trainer, acc, (1, 2))
    trainer.runner.timer.add("weight_sync", 0.5)
    assert _row(trainer, acc, (1, 2))["weight_sync/step_fraction"] == 0.25  # 0.5 s of a 2 s step


def test_close_ends_channel_b_through_its_protocol_and_then_the_sinks_whatever_it_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop knows only `ChannelB.close(deadline_s)` (half the watchdog's shutdown phase), whichever
    Channel-B it is: no client or weight sync of its own to close. A Channel-B that fails to stop (a stuck
    prefetcher) is raised, after the sinks are closed and the process group torn down without the final
    barrier's promise being broken."""
    from stagectl.learner.loop import Trainer

    calls: list[Any] = []

    class Channel:
        def close(self, deadline_s: float) -> None:
            calls.append(("channel_b.close", deadline_s))
            raise RuntimeError("the Channel-B prefetcher on rank 0 did not stop")

    trainer: Any = object.__new__(Trainer)  # only what `close` reads is set
    trainer.channel_b = Channel()
    trainer.plan = SimpleNamespace(watchdog=SimpleNamespace(shutdown_s=60.0))
    trainer.progress = SimpleNamespace(close=lambda: calls.append("progress"))
    trainer.metrics = SimpleNamespace(close=lambda: calls.append("metrics"))
    trainer.samples = None
    trainer.state = SimpleNamespace(ddp_model=object())
    trainer.runner = SimpleNamespace(ddp_model=object())
    monkeypatch.setattr(dist, "teardown", lambda final_barrier: calls.append(("teardown", final_barrier)))
    with pytest.raises(RuntimeError, match="did not stop"):
        trainer.close(finished=True)
    assert calls == [("channel_b.close", 30.0), "progress", "metrics", ("teardown", True)]
    assert trainer.state.ddp_model is None and trainer.runner.ddp_model is None


@pytest.mark.parametrize(("step", "signum", "stopped"), [(8, 2, 2), (24, 15, None), (24, None, None)])
def test_final_state_says_how_the_run_ended(
    tmp_path: Any, step: int, signum: int | None, stopped: int | None
) -> None:
    """Written at the end and on a signal stop: the steps done of max_steps and the signal that stopped the
    run early (`rundir.ending.run_end` reads them: a stopped run is not "finished")."""
    import json

    import torch

    from stagectl.learner.channel_b.protocol import BStepLedger
    from stagectl.learner.loop import Trainer
    from stagectl.stopping import StopSignals

    trainer: Any = object.__new__(Trainer)
    trainer.state = SimpleNamespace(bundle=SimpleNamespace(model=torch.nn.Linear(2, 2)))
    trainer.plan = SimpleNamespace(training=SimpleNamespace(max_steps=24), output_dir=tmp_path)
    trainer.world = SimpleNamespace(is_main=True)
    trainer.num_updates, trainer.b_steps, trainer._stop = step, BStepLedger(), StopSignals()
    trainer._stop.signum = signum
    trainer._write_final_state(step)
    written = json.loads((tmp_path / "final_state.json").read_text())
    assert (written["global_step"], written["max_steps"], written["stopped_by_signal"]) == (step, 24, stopped)


def test_final_state_that_the_disk_cannot_hold_is_not_left_half_written(tmp_path: Any) -> None:
    """A full disk while final_state.json is written (RLIMIT_FSIZE stands for it: writes past 64 bytes fail)
    left the first 64 bytes of it: JSON that reads as no end at all. It is replaced whole or not at all."""
    import json
    import resource
    import signal

    import torch

    from stagectl.learner.channel_b.protocol import BStepLedger
    from stagectl.learner.loop import Trainer
    from stagectl.stopping import StopSignals

    trainer: Any = object.__new__(Trainer)
    trainer.state = SimpleNamespace(bundle=SimpleNamespace(model=torch.nn.Linear(2, 2)))
    trainer.plan = SimpleNamespace(training=SimpleNamespace(max_steps=24), output_dir=tmp_path)
    trainer.world = SimpleNamespace(is_main=True)
    trainer.num_updates, trainer.b_steps, trainer._stop = 24, BStepLedger(), StopSignals()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), no signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, limits[1]))
    try:
        with pytest.raises(OSError):
            trainer._write_final_state(24)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert [p.name for p in tmp_path.iterdir()] == []
    trainer._write_final_state(24)
    assert json.loads((tmp_path / "final_state.json").read_text())["global_step"] == 24


def test_servers_lost_inside_a_step_mode_b_step_end_the_run_naming_the_checkpoint_to_resume_from(
    tmp_path: Any,
) -> None:
    """Step mode probes the servers before a B step; one that dies after the probe (during the push or the
    rollouts) failed the run with a WeightPushError / RolloutServerError traceback. The run now ends with
    one error naming the step, the failure and the latest checkpoint (the half-made step is not saved)."""
    from stagectl.learner.loop import Trainer
    from stagectl.stopping import StopSignals
    from stagectl.wire.errors import RolloutServerError

    (tmp_path / "checkpoint-90").mkdir()
    (tmp_path / "checkpoint-90" / "trainer_state.json").write_text("{}")
    trainer: Any = object.__new__(Trainer)  # only what `run` reads before the step is set
    trainer.plan = SimpleNamespace(training=SimpleNamespace(max_steps=200), output_dir=tmp_path)
    trainer.state = SimpleNamespace(start_step=91)
    trainer._stop = StopSignals()
    trainer.channel_b = SimpleNamespace(start=lambda: None)
    trainer.close = lambda finished: None

    def train_step(step: int) -> dict[str, Any]:
        raise RolloutServerError("rollout http://127.0.0.1:9 requests [0, 4) seed=1: server gone")

    trainer.train_step = train_step
    with pytest.raises(dist.SharedError) as info:
        trainer.run()
    assert str(info.value) == (
        "B step 92: the rollout servers failed during the step (RolloutServerError: rollout "
        "http://127.0.0.1:9 requests [0, 4) seed=1: server gone); the latest checkpoint is "
        f"{tmp_path / 'checkpoint-90'}; once a server answers, continue with: stagectl train-ab "
        f"{tmp_path / 'config.yaml'} --resume"
    )


def test_a_resumed_run_drops_the_old_end_once_its_first_step_is_done(tmp_path: Any) -> None:
    """A run resumed after a failure (or a stop) has that end's final_state.json in its directory; once the
    resumed run completes a step it is running again, and `stagectl report` or a refusal must not read the
    old end meanwhile. A resumed start that fails before its first step keeps it."""
    import json

    from stagectl.learner.loop import Trainer
    from stagectl.stopping import StopSignals

    old_end = {
        "global_step": 10,
        "max_steps": 10,
        "stopped_by_signal": None,
        "error": "no space left on device",
    }
    (tmp_path / "final_state.json").write_text(json.dumps(old_end))
    seen: list[bool] = []
    trainer: Any = object.__new__(Trainer)  # only what `run` reads is set
    trainer.plan = SimpleNamespace(
        training=SimpleNamespace(max_steps=10, logging_steps=1, saves_checkpoint=lambda step: False),
        output_dir=tmp_path,
    )
    trainer.state = SimpleNamespace(start_step=8)
    trainer.world = SimpleNamespace(is_main=True)
    trainer._stop, trainer._b_skipped, trainer.metrics, trainer.samples = StopSignals(), None, None, None
    trainer.b_steps = SimpleNamespace(as_dict=lambda: {})
    trainer.channel_b = SimpleNamespace(start=lambda: None)
    trainer.progress = SimpleNamespace(
        update=lambda *a, **k: seen.append((tmp_path / "final_state.json").exists())
    )
    trainer._maybe_evaluate = lambda step: {}
    trainer._write_final_state = lambda step: None
    trainer.close = lambda finished: None
    trainer.train_step = lambda step: {}
    assert trainer.run() == 10
    assert seen == [False, False]  # gone after step 9, before its row was logged

    (tmp_path / "final_state.json").write_text(json.dumps(old_end))

    def fails(step: int) -> dict[str, Any]:
        raise RuntimeError("the first resumed step failed")

    trainer.train_step = fails
    with pytest.raises(RuntimeError):
        trainer.run()
    assert (
        json.loads((tmp_path / "final_state.json").read_text()) == old_end
    )  # its end stays until a step is done
    assert trainer.steps_done == 10


def test_a_step_whose_eval_fails_leaves_no_samples_lines_and_is_not_counted_done(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's samples.jsonl lines were appended inside the step, before its eval and metrics row: a run
    killed (or failed) during an eval had the trained samples of a step metrics.jsonl has no row for, and
    a failed run's final_state.json counted that step done. The lines follow the row now, and the count
    follows both."""
    import json

    from stagectl.learner.loop import Trainer
    from stagectl.learner.metrics import MetricsWriter
    from stagectl.learner.samples import SamplesWriter, read_samples
    from stagectl.stopping import StopSignals

    monkeypatch.setattr(dist, "gather_objects", lambda local: [local])
    trainer: Any = object.__new__(Trainer)  # only what `run` reads is set
    trainer.plan = SimpleNamespace(
        training=SimpleNamespace(max_steps=4, logging_steps=1, saves_checkpoint=lambda step: False),
        output_dir=tmp_path,
    )
    trainer.state = SimpleNamespace(start_step=0)
    trainer.world = SimpleNamespace(is_main=True)
    trainer._stop, trainer._b_skipped = StopSignals(), None
    trainer.metrics = MetricsWriter(tmp_path)
    trainer.samples = SamplesWriter(tmp_path, resume_step=None)
    trainer.steps_done, trainer.b_steps_done = 0, {}
    trainer.b_steps = SimpleNamespace(as_dict=lambda: {})
    trainer.channel_b = SimpleNamespace(start=lambda: None)
    trainer.progress = SimpleNamespace(update=lambda *a, **k: None)
    trainer.close = lambda finished: None

    def train_step(step: int) -> dict[str, Any]:
        trainer._log_samples(step, [("A", 10 + step, step, None, None)])  # the real gather of its samples
        return {"step": step, "kind": "A"}

    def evaluate(step: int) -> dict[str, float]:
        if step == 2:  # the eval after the second update: the run is killed or fails here
            raise RuntimeError("eval failed")
        return {}

    trainer.train_step, trainer._maybe_evaluate = train_step, evaluate
    with pytest.raises(RuntimeError, match="eval failed"):
        trainer.run()
    trainer.metrics.close()
    trainer.samples.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]
    assert [s["step"] for s in read_samples(tmp_path / "samples.jsonl")] == [0]
    assert trainer.steps_done == 1  # final_state.json of the failed run: the steps with a row
