"""`training.wandb`: the Weights & Biases metrics sink (`training.report_to: [wandb]`)."""

from __future__ import annotations

from typing import Literal

from stagectl.config.base import StrictModel


class WandbConfig(StrictModel):
    project: str = "stagectl"
    """W&B project the run is logged to."""
    entity: str | None = None
    """W&B entity (user or team); null: the logged-in default."""
    run_name: str | None = None
    """Display name of the run; null: the name of `training.output_dir`."""
    mode: Literal["online", "offline"] | None = None
    """`offline` writes the run under `{output_dir}/wandb/` without any network (upload it later with
    `wandb sync`); null: `$WANDB_MODE`, else online."""
