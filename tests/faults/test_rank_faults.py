"""One torchrun rank raising mid-step: every rank (and the embedded rollout server, and torchrun) exits
non-zero well within the collective timeout, with the failing rank's error in the output, and no
process of the run is left (checked pid by pid, from the records of the injection hook)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.faults.helpers import FaultRun, fault_run, report
from tests.integration.helpers import MISSION, async_config, read_metrics, stage_b_config, write_config

DIST_TIMEOUT_S = 60


def _exit_figures(run: FaultRun, code: int) -> tuple[float, float]:
    """Seconds from the injected fault to the CLI's exit, and to the last process of the run gone."""
    exited = time.time()
    left = run.wait_no_leftovers(DIST_TIMEOUT_S)
    assert not left, [(e["pid"], e["argv"]) for e in left]
    all_gone = time.time()
    (fault_at,) = run.fault_times()
    assert code != 0, run.tail()
    return exited - fault_at, all_gone - fault_at


def test_train_ab_async_rank_raising_mid_step_ends_every_process(tmp_path: Path) -> None:
    """2 async learner ranks + the embedded server; rank 1 raises in its 7th forward/backward, the first
    micro-step of step 3, while rank 0 goes on into the step's gradient all-reduce."""
    cfg = async_config(tmp_path, training={"max_steps": 30}, launch={"watchdog": {"step_s": DIST_TIMEOUT_S}})
    config = write_config(tmp_path / "cfg.yaml", cfg)
    with fault_run(["train-ab", str(config)], tmp_path, fault="raise_in_micro_step:1:7") as run:
        code = run.finish(240)
        to_exit, to_all_gone = _exit_figures(run, code)
        assert run.num_processes() == 5  # CLI, server, torchrun, 2 ranks
    output = run.output()
    assert "injected fault: rank 1 failed in forward/backward call 7" in output
    assert to_exit < DIST_TIMEOUT_S and to_all_gone < DIST_TIMEOUT_S
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]  # rank 0 never logged the failed step 3
    report(
        fault="train-ab async: rank 1 raises mid-step",
        failed_cleanly=True,
        exit_code=code,
        exit_after_fault_s=round(to_exit, 1),
        all_processes_gone_s=round(to_all_gone, 1),
        processes=5,
    )


def test_stage_b_rank_raising_ends_every_process(tmp_path: Path) -> None:
    """2 Stage-B ranks with the rule engine; rank 1 raises while judging global batch 1."""
    cfg = stage_b_config(tmp_path, launch={"watchdog": {"step_s": DIST_TIMEOUT_S}})
    config = write_config(tmp_path / "cfg.yaml", cfg)
    with fault_run(["stage-b", str(config), "--nproc", "2"], tmp_path, fault="raise_in_judge:1:1") as run:
        code = run.finish(180)
        to_exit, to_all_gone = _exit_figures(run, code)
        assert run.num_processes() == 4  # CLI, torchrun, 2 ranks
    assert "injected fault on rank 1 in global batch 1" in run.output()
    assert to_exit < DIST_TIMEOUT_S and to_all_gone < DIST_TIMEOUT_S
    selections = tmp_path / "out" / "r" / MISSION / "selections.jsonl"
    assert {json.loads(line)["batch_index"] for line in selections.read_text().splitlines()} == {0}
    report(
        fault="stage-b: rank 1 raises in global batch 1",
        failed_cleanly=True,
        exit_code=code,
        exit_after_fault_s=round(to_exit, 1),
        all_processes_gone_s=round(to_all_gone, 1),
        processes=4,
    )
