"""How a train-ab run ended (`final_state.json`: finished, stopped at step N of M by a signal, or failed after
step N with an error) and the lines that say so and how to continue it. Pure path logic, no torch."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagectl.files import RESOLVED_CONFIG, atomic_write_text
from stagectl.rundir.resume import latest_complete_checkpoint, read_yaml

FINAL_STATE = "final_state.json"


def signal_name(signum: int) -> str:
    """`SIGINT` for 2 (`signal N` for a number with no name here)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def continue_command(out: Path) -> str:
    """The whole command that continues the run in `out`: its own config.yaml holds every --set, the
    learner count and, for an embedded server, `rollout_server.embedded: true`."""
    return f"stagectl train-ab {out / RESOLVED_CONFIG} --resume"


def go_on_note(out: Path) -> str:
    """How to go on from the run in `out`, which did not finish: continue it from its newest complete
    checkpoint (`--resume`), or, when it saved none (it ended before its first save, or a second signal
    stopped it at once), start it again (`--overwrite`): train-ab refuses to resume a run without one."""
    latest = latest_complete_checkpoint(out)
    if latest is None:
        return (
            "it saved no checkpoint, which --resume needs: start it again with "
            f"`stagectl train-ab {out / RESOLVED_CONFIG} --overwrite`"
        )
    return f"continue it from {latest} with `{continue_command(out)}`"


def stop_note(signum: int, step: int, max_steps: int, out: Path) -> str:
    """The end line of a run stopped by a signal: where its checkpoint is and how to continue it."""
    return (
        f"stopped by {signal_name(signum)} after step {step} of {max_steps}; checkpoint saved "
        f"({out / f'checkpoint-{step}'}). Continue with: {continue_command(out)}"
    )


def abort_note(signum: int, out: Path) -> str:
    """The end line of a run a second signal stopped at once (no checkpoint of its last steps)."""
    latest = latest_complete_checkpoint(out)
    last = (
        f"the last good checkpoint is {latest}; continue with: {continue_command(out)}"
        if latest is not None
        else "no checkpoint was written (nothing to resume from)"
    )
    return f"a second {signal_name(signum)} stopped the run at once, without a checkpoint: {last}"


def mid_step_loss_note(step: int, exc: BaseException, out: Path) -> str:
    """The error of a step-mode run whose rollout servers failed inside B step `step` (0-based), after its
    probe found them serving: that step is not saved (its rollouts and gradients were half made), so the run
    continues from the latest checkpoint."""
    latest = latest_complete_checkpoint(out)
    resume = (
        f"the latest checkpoint is {latest}; once a server answers, continue with: {continue_command(out)}"
        if latest is not None
        else "no checkpoint was written yet (nothing to resume from)"
    )
    return f"B step {step + 1}: the rollout servers failed during the step ({type(exc).__name__}: {exc}); {resume}"


def write_failed_state(out: Path, step: int, max_steps: int, error: str, b_steps: Mapping[str, Any]) -> None:
    """Rank 0's `final_state.json` of a run an error ended after `step` completed steps: the report and a
    later reader see "failed after step N of M: why", not a run that might still be going. A disk too full
    for it is said on stderr (the error itself is already there)."""
    state = {"global_step": step, "max_steps": max_steps, "stopped_by_signal": None, "error": error}
    try:
        atomic_write_text(out / FINAL_STATE, json.dumps({**state, "b_steps": dict(b_steps)}, indent=2))
    except OSError as exc:
        print(f"train-ab: could not record the failure in {out / FINAL_STATE} ({exc})", file=sys.stderr)


@dataclass(frozen=True)
class RunEnd:
    """What `final_state.json` says about the end of a run (written when it reached `max_steps`, when a
    signal stopped it and when an error ended it). `max_steps`: None when neither the file nor config.yaml
    names it."""

    step: int
    max_steps: int | None
    stopped_by_signal: int | None
    error: str | None = None

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return False
        if self.max_steps is not None:
            return self.step >= self.max_steps
        return self.stopped_by_signal is None

    def describe(self, *, why: bool = True) -> str:
        """`finished`, `stopped at step 8 of 200 (SIGINT)` or `failed after step 8 of 200: why` (without
        `: why` for a one-line summary)."""
        if self.finished:
            return "finished"
        of = f" of {self.max_steps}" if self.max_steps is not None else ""
        if self.error is not None:
            return f"failed after step {self.step}{of}" + (f": {self.error}" if why else "")
        by = f" ({signal_name(self.stopped_by_signal)})" if self.stopped_by_signal is not None else ""
        return f"stopped at step {self.step}{of}{by}"


def run_end(final_state: Mapping[str, Any], config_max_steps: int | None = None) -> RunEnd:
    """The end `final_state` records; `config_max_steps` (config.yaml's) for a file from before it held
    `max_steps`. `ValueError` when `global_step` is missing."""
    if not isinstance(final_state.get("global_step"), int):
        raise ValueError(f"{FINAL_STATE} has no integer global_step")
    max_steps = final_state.get("max_steps", config_max_steps)
    stopped = final_state.get("stopped_by_signal")
    error = final_state.get("error")
    return RunEnd(
        step=final_state["global_step"],
        max_steps=max_steps if isinstance(max_steps, int) else None,
        stopped_by_signal=stopped if isinstance(stopped, int) else None,
        error=str(error) if error is not None else None,
    )


def read_run_end(out: Path) -> RunEnd | None:
    """`run_end` of `out/final_state.json` (None when there is none or it cannot be read)."""
    try:
        final_state = json.loads((out / FINAL_STATE).read_text())
        config = read_yaml(out / RESOLVED_CONFIG)
        max_steps = config.get("training", {}).get("max_steps") if isinstance(config, dict) else None
        return run_end(final_state, max_steps if isinstance(max_steps, int) else None)
    except (OSError, ValueError, AttributeError):
        return None
