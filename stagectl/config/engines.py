"""What each rollout-server engine can do, declared once per engine (`ENGINES`). The config rules, the doctor
and the learner read an engine's capabilities, never its name; each engine class in `stagectl.engines`
carries its entry (`capabilities = ENGINES["hf"]`). Pure data, no torch: the config layer reads it while
validating a YAML, the learner while reading a server's `/version/` answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class EngineCapabilities:
    merges_adapter: bool
    """Takes `vllm.sync.mode: adapter` syncs (the adapter tensors alone, float32) and merges them onto its
    own float32 base copy; an engine without it gets the merged weights (a full sync)."""
    devices: Literal["one", "tensor_parallel"]
    """How many `rollout_server.devices` it runs on: `one`, or `tensor_parallel` (as many as
    `rollout_server.vllm.tensor_parallel_size`)."""
    adds_coord_tokens: bool
    """Serving a train-ab config it adds the coordinate tokens as the learner does; an engine without it
    serves the checkpoint as it is, which must hold them already (`stagectl export --add-coord-tokens`)."""


ENGINES: dict[str, EngineCapabilities] = {
    "hf": EngineCapabilities(merges_adapter=True, devices="one", adds_coord_tokens=True),
    "vllm": EngineCapabilities(merges_adapter=False, devices="tensor_parallel", adds_coord_tokens=False),
    "fake": EngineCapabilities(
        merges_adapter=False, devices="one", adds_coord_tokens=False
    ),  # tests, benchmarks
}


def merges_adapter(engine: str) -> bool:
    """Whether a server reporting `engine` (its `/version/` answer) merges adapter syncs; an engine stagectl
    does not know (another server's) does not."""
    capabilities = ENGINES.get(engine)
    return capabilities is not None and capabilities.merges_adapter
