"""`stagectl eval CONFIG [--model PATH | --server URL] [--data JSONL] [--out DIR] [--nproc N] [--gallery N]
[--set k=v]`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from stagectl.cli.common import fail

if TYPE_CHECKING:
    from stagectl.config.plan_eval import EvalSession
    from stagectl.config.training import WatchdogConfig

SHOWN = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "f1", "precision", "recall")
# box vs label: class-agnostic AP, the label's share of the box hits, the desc-aware F1, the score's worth
SHOWN_LABELS = ("AP_agnostic", "AP50_agnostic", "desc_accuracy", "f1_desc", "AP_constant_score")


def command(
    config: Path = typer.Argument(..., help="YAML config (the training config: model, data.eval, sampling)."),
    model: str | None = typer.Option(
        None,
        "--model",
        help="Checkpoint to evaluate (model.name_or_path): a train-ab checkpoint-N dir, a run dir (its newest "
        "checkpoint, as export reads it) or any model dir.",
    ),
    server: str | None = typer.Option(
        None,
        "--server",
        help="Evaluate a running rollout server at http(s)://HOST:PORT instead (its token: "
        "rollout_matching.vllm.server.auth_token_env); "
        "the model's tokenizer (--model / model.name_or_path) parses its answers.",
    ),
    data: Path | None = typer.Option(None, "--data", help="JSONL to evaluate on (data.eval.jsonl)."),
    out: Path | None = typer.Option(
        None, "--out", help="Output directory (default: {training.output_dir}/eval)."
    ),
    nproc: int | None = typer.Option(None, "--nproc", min=1, help="Ranks sharding the images (torchrun)."),
    score: str | None = typer.Option(
        None,
        "--score",
        help="Per-object score COCO AP ranks by (data.eval.score): coord, coord_desc, objectness or "
        "objectness_coord_desc; metrics.json holds every kind's AP either way (AP_by_score).",
    ),
    gallery: int | None = typer.Option(
        None,
        "--gallery",
        min=0,
        help="Draw the N worst images (most misses + false positives; only images with one) into DIR/gallery/ "
        "with an index.html (data.eval.gallery_images, default 24); 0: no gallery.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="DIR holds an earlier eval: move it aside to DIR.replaced-<time> first."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a key: --set data.eval.max_samples=null (every image)"
    ),
) -> None:
    """Evaluate a checkpoint (or a rollout server) on a JSONL set: COCO bbox AP/AR (class-aware and
    class-agnostic), box-only and desc-aware F1 at IoU 0.5, desc accuracy, invalid and duplicate rates, a
    per-class AP table; writes DIR/metrics.json, DIR/predictions.coco.json and the worst images drawn under
    DIR/gallery/. A DIR that holds an earlier eval is refused unless --overwrite."""
    from stagectl.config import ConfigError, load_config
    from stagectl.config.plan_eval import eval_session
    from stagectl.launch import as_the_only_rank, inside_torchrun, relaunch_under_torchrun
    from stagectl.rundir.policy import EVAL_MARKERS, RunDirPolicy, apply_policy, files_summary

    sets = list(overrides)
    if model is not None:
        sets.append(f"model.name_or_path={model}")
    if data is not None:
        sets += [f"data.eval.jsonl={data.expanduser().absolute()}", "data.eval.synthetic=null"]
    if nproc is not None:
        sets.append(f"launch.nproc_per_node={nproc}")
    if score is not None:
        sets.append(f"data.eval.score={score}")
    if gallery is not None:
        sets.append(f"data.eval.gallery_images={gallery}")
    try:
        cfg = load_config(config, sets, trains=False)  # --nproc shards images: no training-world rules
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    try:
        session = eval_session(cfg, server)
    except ValueError as exc:
        fail(str(exc))
    out_dir = out if out is not None else Path(cfg.training.output_dir) / "eval"
    if not inside_torchrun():  # once, before any rank starts (the ranks get the same --out)
        try:
            note = apply_policy(
                out_dir,
                files_summary(out_dir, EVAL_MARKERS),
                RunDirPolicy(overwrite=overwrite),
                key="--out",
                command="--out NEW_DIR",
                can_resume=False,
            )
        except ValueError as exc:
            fail(str(exc))
        if note is not None:
            typer.echo(note, err=True)
    if cfg.launch.nproc_per_node * cfg.launch.nnodes > 1 and not inside_torchrun():
        args = ["eval", str(config), "--out", str(out_dir), *(a for s in sets for a in ("--set", s))]
        if server is not None:
            args += ["--server", server]
        code = relaunch_under_torchrun(args, cfg.launch)
        if code:
            raise typer.Exit(code)
        return
    as_the_only_rank()  # one process (or a rank torchrun started): a stale $WORLD_SIZE is not its world
    try:
        _evaluate(session, out_dir, cfg.launch.watchdog)
    except KeyboardInterrupt:
        typer.echo(interrupted_line(out_dir), err=True)
        raise typer.Exit(130) from None


def interrupted_line(out_dir: Path) -> str:
    """The end line of an eval a Ctrl-C stopped: what it left in `out_dir` (its files are written only at
    the end, `metrics.json` last, and `out_dir` held none of them when it started)."""
    from stagectl.rundir.policy import EVAL_MARKERS, files_summary

    left = files_summary(out_dir, EVAL_MARKERS)
    if left is None:
        return f"eval: interrupted (SIGINT); nothing was written to {out_dir} (an eval writes its files when it ends)"
    if (out_dir / "metrics.json").exists():
        return f"eval: interrupted (SIGINT) after its results were written ({left} in {out_dir})"
    return (
        f"eval: interrupted (SIGINT) while writing its results: {out_dir} holds {left} but no metrics.json; "
        "they are incomplete, run the eval again with --overwrite"
    )


def _evaluate(session: EvalSession, out_dir: Path, watchdog: WatchdogConfig) -> None:
    from stagectl import dist
    from stagectl.evaluation.session import run_eval
    from stagectl.wire.errors import RolloutServerError

    world = dist.read_world()
    try:
        dist.init_distributed(world, watchdog)
        run = run_eval(session, out_dir, rank=world.rank, world_size=world.world_size)
        dist.teardown()
    except (ValueError, FileNotFoundError, TimeoutError, RolloutServerError, dist.CollectiveError) as exc:
        fail(str(exc) or type(exc).__name__)
    if run is None or int(os.environ.get("RANK", "0")) != 0:
        return
    m = run.report.metrics
    typer.echo("  ".join(f"{name}={m[name]:.4f}" for name in SHOWN))
    typer.echo("  ".join(f"{name}={m[name]:.4f}" for name in SHOWN_LABELS) + f"  score={m['score']}")
    typer.echo(
        f"images={m['n_images']} (of {run.num_available})  valid_json_rate={m['valid_json_rate']:.3f}  "
        f"truncated_rate={m['truncated_rate']:.3f}  "
        f"dup_rate={m['dup_rate']:.3f}  unknown_category={m['n_unknown_category']}  "
        f"{run.images_per_s:.2f} images/s"
    )
    if m["n_images"] < run.num_available:
        typer.echo(
            f"note: evaluated the first {m['n_images']} of {run.num_available} samples (data.eval.max_samples); "
            "--set data.eval.max_samples=null for all",
            err=True,
        )
    typer.echo(f"eval: wrote {', '.join(str(p) for p in run.written)}")
