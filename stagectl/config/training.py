"""`training` and `launch` sections: the optimizer loop and how processes are started."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from stagectl.config.base import StrictModel
from stagectl.config.reporting import WandbConfig


class TrainingConfig(StrictModel):
    per_device_train_batch_size: int = Field(2, ge=1)
    """Samples per rank per micro-step (Channel-A) and the unit of the default rollout budget."""
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    """Micro-steps per optimizer step (GAS). Derived from `effective_batch_size` when unset; default 1."""
    effective_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step across all ranks; must equal per_device x world_size x GAS."""
    learning_rate: float = Field(1e-4, gt=0)
    """Peak AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup length in optimizer steps."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the decay as a fraction of `learning_rate`."""
    max_steps: int = Field(20, ge=1)
    """Number of optimizer steps (updates, not micro-steps)."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm; null disables clipping."""
    packing: bool = True
    """Pack segments into sequences of `global_max_length` tokens (position ids restart per segment)."""
    packing_min_fill_ratio: float = Field(0.0, ge=0, le=1)
    """Warn when a step's mean pack fill falls below this ratio (0 disables the warning)."""
    seed: int = 0
    """Seed for model init, sampling, shuffling and rollout seeds (rollout seed = f(seed, step))."""
    output_dir: Path = Path("runs/train_ab")
    """Run directory: resolved config, metrics.jsonl, checkpoints."""
    logging_steps: int = Field(1, ge=1)
    """Console progress refresh period in optimizer steps (metrics.jsonl gets every step)."""
    save_steps: int = Field(0, ge=0)
    """Save a checkpoint every N optimizer steps (0 = only at the end)."""
    save_total_limit: int | None = Field(None, ge=1)
    """Keep at most this many step checkpoints (oldest removed first); null keeps all."""
    resume_from_checkpoint: Path | Literal["latest"] | None = None
    """A checkpoint directory to resume from, or `latest` for the newest one in `output_dir`."""
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    """Extra metric sinks besides metrics.jsonl: `tensorboard` (the `tensorboard` extra) and `wandb`
    (the `wandb` extra; see `training.wandb`). Every metrics row goes to each of them."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases run settings (used with `report_to: [wandb]`)."""


class LaunchConfig(StrictModel):
    nproc_per_node: int = Field(1, ge=1)
    """Learner processes on this node; > 1 re-launches under torchrun (the CLI `--nproc` overrides)."""
    nnodes: int = Field(1, ge=1)
    """Number of nodes (multi-node needs `rdzv_endpoint`)."""
    master_port: int | None = Field(None, ge=1, le=65535)
    """Rendezvous port for single-node runs; null picks a free one."""
    rdzv_endpoint: str | None = None
    """`host:port` of the rendezvous for multi-node runs."""
    dist_timeout_s: float = Field(600.0, gt=0)
    """Collective timeout: a rank stuck this long fails instead of hanging."""
