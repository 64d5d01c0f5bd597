"""The config check: the YAML plus `--set` overrides validates (schema and the cross-section `validate_*`
rules) for the world size the run will have, and it is a train-ab config."""

from __future__ import annotations

from pathlib import Path

from stagectl.config import ConfigError, StagectlConfig, effective_world_size, load_config
from stagectl.doctor.report import Check, fail, ok


def check_config(
    path: Path, overrides: list[str], world_size: int | None
) -> tuple[StagectlConfig | None, list[Check]]:
    """The validated config (None when it is invalid) and its check line(s): one fail line per problem."""
    try:
        cfg = load_config(path, overrides, world_size=world_size)
    except ConfigError as exc:
        return None, [
            fail("config", str(problem), "edit the key named (`stagectl validate-config` prints them too)")
            for problem in exc.problems
        ]
    if cfg.stage2_ab is None or cfg.data is None:
        missing = "stage2_ab" if cfg.stage2_ab is None else "data"
        return None, [
            fail(
                "config",
                f"{path} has no {missing} section: doctor checks train-ab configs",
                "add stage2_ab.schedule.b_ratio and a data section (see examples/tiny/train_ab.yaml)",
            )
        ]
    n = effective_world_size(cfg, world_size)
    return cfg, [ok("config", f"{path} is valid for world size {n}")]
