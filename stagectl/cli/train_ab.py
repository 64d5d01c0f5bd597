"""`stagectl train-ab CONFIG [--nproc N] [--set key=value ...]`."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import typer

from stagectl.cli.common import fail


def command(
    config: Path = typer.Argument(..., help="YAML config."),
    nproc: int | None = typer.Option(
        None, "--nproc", min=1, help="Learner processes; > 1 re-launches under torchrun (overrides launch)."
    ),
    overrides: list[str] = typer.Option([], "--set", help="Override a key: --set training.max_steps=10"),
) -> None:
    """Run Stage-2 AB training (re-launches itself under torchrun when nproc > 1)."""
    from stagectl.config import ConfigError, effective_world_size, load_config
    from stagectl.launch import inside_torchrun

    sets = list(overrides)
    if nproc is not None:
        sets.append(f"launch.nproc_per_node={nproc}")
    try:
        cfg = load_config(config, sets, world_size=None if inside_torchrun() else _world(nproc))
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    world_size = effective_world_size(cfg)
    if cfg.stage2_ab is None:
        fail(f"{config}: train-ab needs a stage2_ab section (stage2_ab.schedule.b_ratio)")
    if cfg.stage2_ab.channel_b.mode == "async" or cfg.custom.extra.rollout_matching.rollout_backend == "vllm":
        fail(
            "server-mode rollouts (rollout_backend: vllm) and channel_b.mode: async are not implemented yet; "
            "use rollout_backend: hf with channel_b.mode: step",
            code=2,
        )
    if world_size > 1 and not inside_torchrun():
        raise typer.Exit(_relaunch(config, sets, cfg))
    _train(cfg)


def _world(nproc: int | None) -> int | None:
    return None if nproc is None else nproc


def _relaunch(config: Path, sets: list[str], cfg: object) -> int:
    from stagectl.config import StagectlConfig
    from stagectl.launch import child_env, torchrun_argv

    assert isinstance(cfg, StagectlConfig)
    args = ["train-ab", str(config), *(a for s in sets for a in ("--set", s))]
    argv = torchrun_argv(
        args,
        nproc_per_node=cfg.launch.nproc_per_node,
        nnodes=cfg.launch.nnodes,
        master_port=cfg.launch.master_port,
        rdzv_endpoint=cfg.launch.rdzv_endpoint,
    )
    typer.echo(f"launching: {shlex.join(argv)}", err=True)
    return subprocess.call(argv, env=child_env())


def _train(cfg: object) -> None:
    from stagectl.config import StagectlConfig
    from stagectl.learner.loop import Trainer

    assert isinstance(cfg, StagectlConfig)
    try:
        trainer = Trainer(cfg)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc) or type(exc).__name__)
    step = trainer.run()
    if trainer.stopped_by_signal is not None:
        typer.echo(
            f"stopped by signal {trainer.stopped_by_signal} after step {step}; checkpoint saved", err=True
        )
    typer.echo(f"train-ab: done, {step} optimizer steps; run dir {cfg.training.output_dir}", err=True)
