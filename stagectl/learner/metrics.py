"""Rank-0 metrics: one JSON row per optimizer step in `{output_dir}/metrics.jsonl`, optional
TensorBoard and Weights & Biases sinks (`training.report_to`), and a rich progress bar on the console.

Every sink gets every row. W&B logs the row at W&B step `row["step"]`, the run's resolved config as the
run config, and keeps its run id in `{output_dir}/wandb_run_id` so a resumed run continues the same
W&B run (its retrained steps stay as first logged there: W&B steps only go forward; the resume says so);
`training.wandb.mode: offline` (or `WANDB_MODE=offline`) needs no network."""

from __future__ import annotations

import json
import math
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from stagectl.console import say
from stagectl.files import atomic_write_lines
from stagectl.rundir.policy import count_rows

if TYPE_CHECKING:
    from stagectl.config.training import TrainingConfig

METRICS_FILE = "metrics.jsonl"
WANDB_RUN_ID_FILE = "wandb_run_id"


class MetricsWriter:
    """Appends rows to metrics.jsonl (flushed every row, so a crash loses nothing already logged)."""

    def __init__(
        self,
        output_dir: Path,
        *,
        tensorboard: bool = False,
        resume_step: int = 0,
        wandb: WandbSink | None = None,
    ) -> None:
        self.path = output_dir / METRICS_FILE
        output_dir.mkdir(parents=True, exist_ok=True)
        # a resumed run keeps the rows before the restored step and replaces the later ones, at its first
        # row (a resume that fails before training a step changes nothing); a new run never truncates rows
        self._resume_step = resume_step
        _refuse_truncation(self.path, resume_step)
        self._handle: Any = None if resume_step else self.path.open("w", encoding="utf-8")
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ValueError(
                    "training.report_to: tensorboard needs the tensorboard package: "
                    "pip install 'stagectl[tensorboard]'"
                ) from exc
            # a resume replays the steps after its checkpoint: purge_step hides the earlier events of those
            # steps, as metrics.jsonl drops its rows (TensorBoard drew both, the curve stepping back)
            self._tb = SummaryWriter(str(output_dir / "tensorboard"), purge_step=resume_step or None)
        self._wandb = wandb

    @classmethod
    def for_training(
        cls, t: TrainingConfig, run_config: Mapping[str, Any], *, resume_step: int = 0
    ) -> MetricsWriter:
        """The writer `training.report_to` asks for, in `training.output_dir`; `run_config`: the resolved
        config as plain data (W&B's run config)."""
        _refuse_truncation(t.output_dir / METRICS_FILE, resume_step)  # before a W&B run is started
        wandb = WandbSink.start(t, run_config, resume_step=resume_step) if "wandb" in t.report_to else None
        return cls(
            t.output_dir, tensorboard="tensorboard" in t.report_to, resume_step=resume_step, wandb=wandb
        )

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: _finite(v) for k, v in row.items()}
        if self._handle is None:
            if self.path.exists():
                keep_rows_before(self.path, self._resume_step)
            self._handle = self.path.open("a", encoding="utf-8")
        self._handle.write(json.dumps(clean) + "\n")
        self._handle.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(key, value, global_step=int(row["step"]))
        if self._wandb is not None:
            self._wandb.log(clean)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()


class WandbSink:
    """One W&B run fed with metrics rows (`wandb` is imported only when this sink is used)."""

    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def start(cls, t: TrainingConfig, run_config: Mapping[str, Any], *, resume_step: int = 0) -> WandbSink:
        try:
            import wandb
        except ImportError as exc:
            raise ValueError(
                "training.report_to: wandb needs the wandb package: pip install 'stagectl[wandb]'"
            ) from exc
        settings = t.wandb
        t.output_dir.mkdir(parents=True, exist_ok=True)
        id_file = t.output_dir / WANDB_RUN_ID_FILE
        if resume_step and id_file.is_file():
            run_id = id_file.read_text().strip()  # a resumed run continues its W&B run
            logged = [row["step"] for _, row in _json_lines(t.output_dir / METRICS_FILE) if _has_step(row)]
            if logged and max(logged) >= resume_step:
                say(
                    "train-ab",
                    f"warning: W&B run {run_id} keeps steps {resume_step}-{max(logged)} (metrics.jsonl's "
                    "`step`) as the interrupted process logged them: a W&B run's steps only go forward, so "
                    "the steps retrained from the checkpoint reach metrics.jsonl and TensorBoard, not W&B",
                )
        else:
            run_id = uuid.uuid4().hex[:8]
            id_file.write_text(run_id + "\n")
        run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.run_name or t.output_dir.name,
            id=run_id,
            resume="allow",
            dir=str(t.output_dir),
            mode=settings.mode,
            config=dict(run_config),
        )
        return cls(run)

    def log(self, row: dict[str, Any]) -> None:
        """Every key of `row` except `step`, at W&B step `row["step"]` (nulls are left out)."""
        values = {k: v for k, v in row.items() if k != "step" and v is not None}
        self.run.log(values, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


def _has_step(row: Any) -> bool:
    return isinstance(row, dict) and isinstance(row.get("step"), int)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _refuse_truncation(path: Path, resume_step: int) -> None:
    if not resume_step and count_rows(path):
        raise ValueError(
            f"{path} already has rows and this run is not a resume; refusing to truncate it "
            "(train-ab --resume continues that run, --overwrite moves it aside)"
        )


def keep_rows_before(path: Path, step: int) -> None:
    """On resume, drop the rows of steps >= `step` (they are about to be re-run) and a torn last line from a
    crash; every other line is kept as it was. Atomic: the file is whole before or after."""
    kept = [
        line if line.endswith("\n") else line + "\n"
        for line, row in _json_lines(path)
        if isinstance(row, dict) and row.get("step", -1) < step
    ]
    atomic_write_lines(path, kept)


def _json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    """Each line of a JSONL file with its decoded value; a torn line (a crash) is skipped."""
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            try:
                yield line, json.loads(line)
            except json.JSONDecodeError:
                continue


def run_rollout_f1s(output_dir: Path) -> list[float]:
    """Every B step's `rollout/f1` in `output_dir`'s metrics.jsonl, in step order: the whole run's, a resumed
    one's earlier steps included (the progress bar has only this process's). Unreadable lines are skipped."""
    path = output_dir / METRICS_FILE
    if not path.is_file():
        return []
    return [
        float(row["rollout/f1"])
        for _, row in _json_lines(path)
        if isinstance(row, dict) and isinstance(row.get("rollout/f1"), int | float)
    ]


def rollout_f1_summary(f1s: Sequence[float]) -> str | None:
    """The end-of-run line about Channel-B rollout F1 (None when the run made no B step). All zeros get
    a word that this is what an untrained model gives, so a first run does not look broken."""
    if not f1s:
        return None
    line = f"Channel-B rollout F1 last {f1s[-1]:.3f}, best {max(f1s):.3f} over {len(f1s)} B steps"
    if max(f1s) > 0:
        return line
    return (
        f"{line}. F1 0 means no rollout object matched a ground-truth box at IoU >= iou_gate yet: expected "
        "for a model that does not yet answer in the detection format, such as the built-in tiny model "
        "(random weights) after a few dozen steps; its loss is what falls. A tiny model that learns the "
        "shapes: examples/tiny/learn_shapes.yaml (2,500 steps)"
    )


class ProgressBar:
    """A rich progress bar with the latest loss / kind / F1; plain lines when not a terminal."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.total = total_steps
        self.console = Console(stderr=True)
        self._progress: Progress | None = None
        if enabled and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train-ab"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("steps", total=total_steps, completed=start_step, info="")
            self._progress.start()

    def update(self, step: int, row: dict[str, Any], log: bool, b_skipped: str | None = None) -> None:
        """`b_skipped`: the step the schedule wanted as Channel-B trained as A, for this reason (`A (B
        wanted: queue_empty)` on its line)."""
        if not self.enabled:
            return
        info = row["kind"] + (f" (B wanted: {b_skipped})" if b_skipped else "") + f" loss={row['loss']:.4f}"
        if "rollout/f1" in row:
            info += f" f1={row['rollout/f1']:.3f}"
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, info=info)
        elif log or step + 1 == self.total:  # the last step's line, whatever logging_steps is
            print(
                f"step {step + 1}/{self.total} {info} ({row['time/step_s']:.2f}s)",
                file=sys.stderr,
                flush=True,
            )

    def note(self, message: str) -> None:
        """A line above the bar (or on stderr without a terminal)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(message)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
