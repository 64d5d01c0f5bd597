"""The one config model of stagectl (pydantic only: importing this never imports torch)."""

from stagectl.config.loader import (
    REMOVED_KEYS,
    ConfigError,
    WorldSizeConflict,
    apply_override,
    effective_world_size,
    launch_world_size,
    load_config,
    nproc_world_size,
    to_plain,
)
from stagectl.config.root import Problem, Resolved, StagectlConfig, resolve_config, uses_server_rollouts

__all__ = [
    "REMOVED_KEYS",
    "ConfigError",
    "Problem",
    "Resolved",
    "StagectlConfig",
    "WorldSizeConflict",
    "apply_override",
    "effective_world_size",
    "launch_world_size",
    "load_config",
    "nproc_world_size",
    "resolve_config",
    "to_plain",
    "uses_server_rollouts",
]
