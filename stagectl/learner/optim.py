"""AdamW with linear warmup then cosine / linear / constant decay (per optimizer step)."""

from __future__ import annotations

import math

import torch

from stagectl.config.training import TrainingConfig


def lr_factor(step: int, cfg: TrainingConfig) -> float:
    """Multiplier of `learning_rate` at 0-indexed optimizer step `step`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_scheduler_type == "constant":
        return 1.0
    decay_steps = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_scheduler_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_optimizer(
    model: torch.nn.Module, cfg: TrainingConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.learning_rate, betas=cfg.adam_betas, weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
    return optimizer, scheduler


def apply_schedule(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set every param group's lr to the schedule's value for the next step (`scheduler.last_epoch`).

    After a resume the optimizer holds the lr it saved, computed under the checkpoint's config, and
    `LambdaLR` only recomputes it at its next `step()`, after the first resumed step ran. With a larger
    `training.max_steps` that first step would still run at the old schedule's value (0 at the end of a
    cosine), so the lr is recomputed from the resumed config here."""
    lrs = [
        base_lr * lmbda(scheduler.last_epoch)
        for base_lr, lmbda in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what `get_last_lr()` (the metrics' `lr`) reports
