"""The metric catalog (`stagectl.metric_keys`) declares every key the in-process metric sources emit: the
rollout counters, the phase timer, the loss terms, the weight publisher, the rollout client and the eval
keys; and it drives the reduction across ranks (`reduce_ranks`, `dist.reduce_metrics`). The keys of a whole
async run are checked in tests/integration/test_train_ab_async.py."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from stagectl import dist, metric_keys
from stagectl.detection.stats import RolloutStats
from stagectl.dist import World
from stagectl.inference.client import RolloutClient
from stagectl.learner.channel_b.publisher import SyncOutcome, WeightPublisher
from stagectl.learner.evaluate import EVAL_LOGGED
from stagectl.learner.loss import LossTerms
from stagectl.timing import PhaseTimer


def test_rollout_stats_phase_timer_and_loss_terms_are_declared() -> None:
    zero = torch.zeros(())
    terms = LossTerms(zero, zero, zero, zero, zero, zero, num_ce_tokens=0, num_boxes=0)
    for source in (RolloutStats().metrics(), PhaseTimer().row(), terms.as_floats()):
        assert metric_keys.undeclared(source) == []


def test_publisher_and_client_counters_are_declared() -> None:
    client = SimpleNamespace(versions=lambda: [SimpleNamespace(version=0)])
    publisher = WeightPublisher(client, torch.nn.Linear(2, 2), World(0, 0, 1), num_updates=0)  # type: ignore[arg-type]
    row = publisher.metrics(SyncOutcome("ok", num_bytes=8, seconds=0.5, state_bytes=8))
    assert "weight_sync/bytes" in row and metric_keys.undeclared(row) == []
    with RolloutClient(["http://127.0.0.1:9"]) as rollouts:
        assert metric_keys.undeclared(f"rollout_client/{k}" for k in rollouts.counters()) == []


def test_the_eval_keys_are_exactly_the_evaluators() -> None:
    declared = {k for k in metric_keys.METRICS if k.startswith(metric_keys.EVAL_PREFIX)}
    assert declared == {metric_keys.EVAL_PREFIX + name for name in EVAL_LOGGED}


def test_undeclared_names_a_new_key() -> None:
    row: dict[str, Any] = {"step": 0, "loss": 1.0, "rollout/brand_new": 2}
    assert metric_keys.undeclared(row) == ["rollout/brand_new"]


def test_every_metric_has_a_doc_and_the_unit_its_name_says() -> None:
    for metric in metric_keys.METRICS.values():
        assert metric.doc.endswith("."), metric
        if metric.key.endswith("_s") and not metric.key.endswith("_per_s"):
            assert metric.unit == "s", metric


def test_every_async_key_the_report_reads_is_declared() -> None:
    """The report names the `stage2_ab/async/*` keys as `ASYNC + "name"`: each must be a declared key."""
    report_dir = Path(metric_keys.__file__).parent / "report"
    names = {n for p in report_dir.glob("*.py") for n in re.findall(r'ASYNC \+ "(\w+)"', p.read_text())}
    assert len(names) >= 8
    assert metric_keys.undeclared(metric_keys.ASYNC_PREFIX + n for n in names) == []


def test_reduce_ranks_applies_each_keys_declared_reduction() -> None:
    """Two ranks' values: `tokens` is summed, `loss` averaged, `packing/fill_min` the smaller, `step` rank 0's,
    an input of a derived key summed; a sum of ints stays an int."""
    rank0 = {"tokens": 30, "loss": 1.0, "packing/fill_min": 0.9, "step": 7, metric_keys.PACKING_CAPACITY: 40}
    rank1 = {"tokens": 12, "loss": 2.0, "packing/fill_min": 0.25, "step": 7, metric_keys.PACKING_CAPACITY: 16}
    out = metric_keys.reduce_ranks([rank0, rank1])
    assert out == {
        "tokens": 42,
        "loss": 1.5,
        "packing/fill_min": 0.25,
        "step": 7,
        metric_keys.PACKING_CAPACITY: 56,
    }
    assert isinstance(out["tokens"], int)
    assert list(out) == list(rank0)


def test_reduce_ranks_refuses_an_undeclared_a_derived_or_a_missing_key() -> None:
    with pytest.raises(ValueError, match="'rollout/brand_new' is not declared"):
        metric_keys.reduce_ranks([{"rollout/brand_new": 1}])
    with pytest.raises(ValueError, match="'packing/fill' is derived"):
        metric_keys.reduce_ranks([{"packing/fill": 0.5}])
    with pytest.raises(ValueError, match=r"rank 1 reduces other metric keys than rank 0: \['loss'\]"):
        metric_keys.reduce_ranks([{"tokens": 1, "loss": 1.0}, {"tokens": 1}])


def test_two_ranks_reduce_in_one_collective_by_the_catalog(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dist.reduce_metrics` gathers every rank's values once and reduces them by the catalog (rank 1 is
    played by the gather)."""
    rank1 = {"loss/ce": 3.0, "stage2_ab/async/queue_depth": 5, "stage2_ab/async/ver_current": 9}
    gathered: list[object] = []

    def all_gather_objects(obj: Any) -> list[Any]:
        gathered.append(obj)
        return [obj, rank1]

    monkeypatch.setattr(dist, "all_gather_objects", all_gather_objects)
    local = {"loss/ce": 1.0, "stage2_ab/async/queue_depth": 2, "stage2_ab/async/ver_current": 4}
    out = dist.reduce_metrics(local)
    assert len(gathered) == 1
    assert out == {"loss/ce": 2.0, "stage2_ab/async/queue_depth": 7, "stage2_ab/async/ver_current": 4}
