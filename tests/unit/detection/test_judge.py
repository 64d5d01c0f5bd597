"""`judge_rollout`'s counters, which Channel-B's `rollout/*` metrics and the eval share: an answer that stops on
a syntax error is invalid (it was counted neither invalid nor truncated)."""

from __future__ import annotations

import pytest

from stagectl.detection.judge import judge_rollout
from stagectl.detection.serialize import BoxedObject
from stagectl.detection.stats import RolloutStats
from tests.unit.helpers import CHAR, Obj

GT: list[BoxedObject] = [Obj("cat", (100, 100, 300, 300))]
CLOSED = '{"object_1": {"desc": "cat", "bbox_2d": ["<|coord_100|>", "<|coord_100|>", "<|coord_300|>", "<|coord_300|>"]}}'


@pytest.mark.parametrize(
    ("text", "invalid", "truncated"),
    [
        (CLOSED + "<|im_end|>", 0, 0),
        ('{"object_1": {"desc": "bbox_2d": "bbox_2d": "<|coord_378|>", ', 1, 0),  # a syntax error
        ("no json here", 1, 0),
        (CLOSED[:40], 0, 1),
    ],
)
def test_each_answer_counts_as_closed_truncated_or_invalid(text: str, invalid: int, truncated: int) -> None:
    *_, stats = judge_rollout(CHAR.encode(text), GT, CHAR.vocab, duplicate_iou_threshold=0.9)
    assert (stats.n_invalid, stats.n_truncated) == (invalid, truncated)


def test_rollout_rates_of_a_syntax_error_batch() -> None:
    total = RolloutStats()
    for text in ('{"object_1": {"desc": "bbox_2d": "x"', CLOSED):
        total.add(judge_rollout(CHAR.encode(text), GT, CHAR.vocab, duplicate_iou_threshold=0.9)[3])
    metrics = total.metrics()
    assert (metrics["rollout/invalid_rate"], metrics["rollout/parse_truncated_rate"]) == (0.5, 0.0)
