"""Which samples an eval scores: the first `data.eval.max_samples`, or every one with `max_samples: null`
(a COCO score over all of val2017), for `stagectl eval` and train-ab's periodic eval alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagectl.config import ConfigError, load_config
from stagectl.config.model_data import EvalDataConfig
from stagectl.config.plan import eval_plan
from stagectl.evaluation.session import load_eval_samples

CONFIG = Path(__file__).parents[3] / "examples" / "tiny" / "learn_shapes.yaml"
SMALL_SPLIT = "data.eval.synthetic.num_samples=5"


@pytest.mark.parametrize(("max_samples", "expected"), [("3", 3), ("null", 5), ("9", 5)])
def test_max_samples_cuts_the_split_and_null_takes_every_sample(max_samples: str, expected: int) -> None:
    cfg = load_config(CONFIG, [SMALL_SPLIT, f"data.eval.max_samples={max_samples}"])
    samples, num_available, source = load_eval_samples(eval_plan(cfg))
    assert (len(samples), num_available, source) == (expected, 5, "data.eval.synthetic")


def test_the_default_stays_64() -> None:
    cfg = load_config(CONFIG, ["data.eval.max_samples=null"])
    assert cfg.data is not None and cfg.data.eval is not None and cfg.data.eval.max_samples is None
    assert EvalDataConfig().max_samples == 64  # train-ab's periodic eval stays short


def test_zero_is_refused_with_the_key() -> None:
    with pytest.raises(ConfigError, match=r"data\.eval\.max_samples: .*greater than or equal to 1"):
        load_config(CONFIG, ["data.eval.max_samples=0"])
