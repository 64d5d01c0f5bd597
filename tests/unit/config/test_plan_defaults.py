"""The plan's parts declare defaults of their own (tests and evaluation build parts by hand), and the
builders fill every field from the config. The two must not drift: built from a config that leaves every
key at its default, each part holds exactly the defaults it declares. `SamplingSpec` is left out: it is
one spec per use (Channel-B's near-greedy decoding, evaluation's, Stage-B's grid), not a config section."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from stagectl.config import load_config
from stagectl.config.plan import AsyncServers
from stagectl.config.plan_eval import eval_session
from stagectl.config.plan_server import server_plan
from stagectl.config.plan_stage_b import stage_b_plan
from stagectl.config.plan_train import train_plan

TRAIN = [
    "model.name_or_path=builtin:tiny-qwen2.5-vl",
    "data.synthetic.num_samples=8",
    "custom.trainer_variant=stage2_ab_training",
    "stage2_ab.schedule.b_ratio=0.25",
]
SERVERS = [
    "custom.extra.rollout_matching.rollout_backend=vllm",
    "custom.extra.rollout_matching.vllm.mode=server",
    'custom.extra.rollout_matching.vllm.server.servers=[{base_url: "http://127.0.0.1:9"}]',
]
ASYNC = "stage2_ab.channel_b.mode=async"
STAGE_B = ["mission=m", "tickets=[t.jsonl]", "guidance.path=g.json"]
STAGE_B_SERVER = ["runner.engine=server", "runner.server.base_urls=[http://127.0.0.1:9]"]
EVAL = [*TRAIN, "data.eval.synthetic.num_samples=4"]
# fields that name where a part came from, not a setting: a ServerList says which YAML key it was read from
LABELS = {("ServerList", "key"), ("ServerList", "wait_healthy_key")}


def drifted(part: Any, path: str = "plan") -> list[str]:
    """Every field of a plan dataclass (at any depth) whose built value is not the default it declares
    (a part that defaults to a whole part is compared field by field, below)."""
    found: list[str] = []
    if isinstance(part, (list, tuple)):
        for k, item in enumerate(part):
            found += drifted(item, f"{path}[{k}]")
    if not (dataclasses.is_dataclass(part) and type(part).__module__.startswith("stagectl.config.plan")):
        return found
    for f in dataclasses.fields(part):
        value = getattr(part, f.name)
        if (type(part).__name__, f.name) in LABELS:
            continue
        default = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        if default is not dataclasses.MISSING and not dataclasses.is_dataclass(default) and value != default:
            found.append(f"{path}.{f.name}: declares {default!r}, the config's default builds {value!r}")
        found += drifted(value, f"{path}.{f.name}")
    return found


@pytest.mark.parametrize(
    ("name", "build"),
    [
        ("train-ab in process", lambda: train_plan(load_config(None, TRAIN), 1)),
        ("train-ab server step", lambda: train_plan(load_config(None, [*TRAIN, *SERVERS]), 1)),
        ("train-ab async", lambda: train_plan(load_config(None, [*TRAIN, *SERVERS, ASYNC]), 1)),
        ("rollout-server", lambda: server_plan(load_config(None, []))),
        ("stage-b", lambda: stage_b_plan(load_config(None, STAGE_B))),
        ("stage-b server", lambda: stage_b_plan(load_config(None, [*STAGE_B, *STAGE_B_SERVER]))),
        ("eval", lambda: eval_session(load_config(None, EVAL))),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_default_config_builds_the_defaults_each_plan_part_declares(name: str, build: Any) -> None:
    assert drifted(build()) == []


def test_the_check_sees_a_drifted_default() -> None:
    """The walk reaches nested parts: a default changed on one side only is named with its path."""
    plan = train_plan(load_config(None, [*TRAIN, *SERVERS, ASYNC]), 1)
    source = plan.channel_b.source
    assert isinstance(source, AsyncServers)
    moved = dataclasses.replace(source.queue, version_window=source.queue.version_window + 1)
    source = dataclasses.replace(source, queue=moved)
    changed = dataclasses.replace(plan, channel_b=dataclasses.replace(plan.channel_b, source=source))
    assert drifted(changed) == [
        "plan.channel_b.source.queue.version_window: declares 1, the config's default builds 2"
    ]
