"""Engine capabilities (`config.engines`): declared once per engine, carried by each engine class, and what
the checks read instead of the engine's name."""

from __future__ import annotations

from typing import get_args

from stagectl.config.engines import ENGINES, merges_adapter
from stagectl.config.rollout import RolloutServerConfig
from stagectl.engines.fake import FakeEngine
from stagectl.engines.hf import HFEngine
from stagectl.engines.vllm import VllmEngine


def test_every_configurable_engine_declares_its_capabilities() -> None:
    configurable = get_args(RolloutServerConfig.model_fields["engine"].annotation)
    assert set(configurable) <= set(ENGINES)


def test_each_engine_class_carries_its_own_entry() -> None:
    for cls in (HFEngine, VllmEngine, FakeEngine):
        assert cls.capabilities is ENGINES[cls.name]


def test_only_a_known_merging_engine_merges_adapters() -> None:
    assert merges_adapter("hf")
    assert not merges_adapter("vllm")
    assert not merges_adapter("swift")  # another server's engine: stagectl cannot know
