"""The launcher's pure parts: the torchrun argv, rendezvous ids, the rank environment, failure lines."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from stagectl.launch import child_env, run_id_for, torchrun_argv
from stagectl.torchrun import describe_exit, failure_lines
from stagectl.watchdog import ORPHAN_EXIT_CODE, WATCHDOG_EXIT_CODE


def test_single_node_rendezvous_binds_its_own_port_on_loopback() -> None:
    argv = torchrun_argv(["train-ab", "c.yaml"], nproc_per_node=2, run_id="stagectl-x")
    assert argv[:3] == [sys.executable, "-m", "stagectl.torchrun"]
    assert "--rdzv-endpoint=127.0.0.1:0" in argv  # port 0: no free-port race
    assert "--local-addr=127.0.0.1" in argv
    assert "--rdzv-id=stagectl-x" in argv
    assert "--max-restarts=0" in argv
    assert argv[-4:] == ["-m", "stagectl", "train-ab", "c.yaml"]
    fixed = torchrun_argv(["x"], nproc_per_node=2, run_id="r", master_port=29555)
    assert "--rdzv-endpoint=127.0.0.1:29555" in fixed


def test_multi_node_uses_the_shared_endpoint() -> None:
    argv = torchrun_argv(
        ["x"], nproc_per_node=8, run_id="job-7", nnodes=2, rdzv_endpoint="node0.cluster:29400"
    )
    assert "--nnodes=2" in argv and "--rdzv-endpoint=node0.cluster:29400" in argv
    assert not any(a.startswith("--local-addr") for a in argv)
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        torchrun_argv(["x"], nproc_per_node=1, run_id="r", nnodes=2)


def test_run_ids_agree_across_nodes_and_differ_between_single_node_runs() -> None:
    assert run_id_for(2, "job-7", "h:1") == "job-7"
    node_a = run_id_for(2, None, "10.0.0.1:29400")
    assert node_a == run_id_for(2, None, "10.0.0.1:29400")  # every node derives the same id
    assert run_id_for(2, None, "10.0.0.2:29400") != node_a
    assert run_id_for(1, None, None) != run_id_for(1, None, None)


def test_single_node_children_pin_gloo_and_nccl_to_loopback() -> None:
    env = child_env({"X": "1"})
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env["STAGECTL_LAUNCHED"] == "1" and env["X"] == "1"
    multi = child_env(single_node=False)
    assert "GLOO_SOCKET_IFNAME" not in multi or multi["GLOO_SOCKET_IFNAME"] != "lo"


def test_failed_ranks_are_one_line_each_first_failure_first() -> None:
    failures = {
        0: SimpleNamespace(local_rank=0, pid=11, exitcode=-int(signal.SIGKILL), timestamp=20),
        1: SimpleNamespace(local_rank=1, pid=12, exitcode=WATCHDOG_EXIT_CODE, timestamp=10),
    }
    lines = failure_lines(failures)
    assert lines[0].startswith("torchrun: rank 1 (local rank 1, pid 12) failed: exit code 70: its watchdog")
    assert lines[1].endswith("killed by SIGKILL")
    assert "launcher was gone" in describe_exit(ORPHAN_EXIT_CODE)
    assert describe_exit(1) == "exit code 1"


def test_ranks_torchrun_stopped_after_another_failed_come_after_it_and_say_so() -> None:
    """Rank 1 SIGKILLed; torchrun then SIGTERMs rank 0, whose failure it may stamp first (seen: `rank 0
    failed: killed by SIGTERM` printed above the rank that failed)."""
    failures = {
        0: SimpleNamespace(local_rank=0, pid=11, exitcode=-int(signal.SIGTERM), timestamp=10),
        1: SimpleNamespace(local_rank=1, pid=12, exitcode=-int(signal.SIGKILL), timestamp=10),
        2: SimpleNamespace(local_rank=2, pid=13, exitcode=-int(signal.SIGTERM), timestamp=9),
    }
    assert failure_lines(failures) == [
        "torchrun: rank 1 (local rank 1, pid 12) failed: killed by SIGKILL",
        "torchrun: rank 2 (local rank 2, pid 13) failed: stopped by torchrun (SIGTERM) after rank 1 failed",
        "torchrun: rank 0 (local rank 0, pid 11) failed: stopped by torchrun (SIGTERM) after rank 1 failed",
    ]
    # every rank SIGTERMed (a user's signal to the ranks, not torchrun's reaction): said as it is
    only_term = {0: failures[0], 2: failures[2]}
    assert [line.rsplit(": ", 1)[1] for line in failure_lines(only_term)] == ["killed by SIGTERM"] * 2


@pytest.mark.parametrize("user_level", [None, "INFO"])
def test_a_lost_rendezvous_store_is_one_named_line_and_the_ranks_keep_the_user_log_level(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], user_level: str | None
) -> None:
    import torch.distributed.run
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    import stagectl.torchrun

    seen_by_ranks: list[str | None] = []

    def store_gone(args: object) -> None:
        seen_by_ranks.append(os.environ.get("TORCH_CPP_LOG_LEVEL"))  # what torchrun hands its workers
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    monkeypatch.setattr(stagectl.torchrun, "die_with_parent", lambda: None)
    monkeypatch.setattr(torch.distributed.run, "run", store_gone)
    if user_level is None:
        monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", user_level)
    code = stagectl.torchrun.main(
        ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.7:29400", "x.py"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err == [
        "torchrun: lost the rendezvous store at 10.0.0.7:29400: the node hosting it (the first node started at "
        "that endpoint) died or the network broke; this node's ranks were stopped (RendezvousConnectionError)"
    ]
    assert seen_by_ranks == [user_level]


def test_a_dead_launchers_old_plan_dir_is_removed_and_nothing_else(tmp_path: Path) -> None:
    import subprocess

    from stagectl.launch import PLAN_DIR_PREFIX, plan_dir, remove_orphan_plan_dirs

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(gone.stdout)  # the process has exited: its pid runs nothing (unless reused at once)
    old = os.path.getmtime(tmp_path) - 3600

    def make(name: str, age_s: float | None = None) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "plan.json").write_text("{}")
        if age_s is not None:
            os.utime(path, (old, old))
        return path

    orphan = make(f"{PLAN_DIR_PREFIX}{dead_pid}-abc", age_s=3600)
    young = make(f"{PLAN_DIR_PREFIX}{dead_pid}-young")  # a launcher in another pid namespace may be starting
    alive = make(f"{PLAN_DIR_PREFIX}{os.getpid()}-abc", age_s=3600)
    foreign = make(f"{PLAN_DIR_PREFIX}abcdefgh", age_s=3600)  # not our layout: left alone
    assert remove_orphan_plan_dirs(tmp_path) == [orphan]
    assert not orphan.exists() and young.exists() and alive.exists() and foreign.exists()

    with plan_dir() as tmp:  # the launcher's own: named with its pid, gone after the block
        assert tmp.name.startswith(f"{PLAN_DIR_PREFIX}{os.getpid()}-") and tmp.is_dir()
    assert not tmp.exists()


@pytest.mark.parametrize("user_log_dir", [False, True])
def test_torchrun_leaves_no_log_dir_behind_unless_the_user_named_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, user_log_dir: bool
) -> None:
    """torchrun's default `--log-dir` is a fresh /tmp/torchelastic_* per launch that torch never removes (the
    soak found 369 of them in /tmp); stagectl.torchrun's own is gone when torchrun ends, a user's stays."""
    import tempfile

    import torch.distributed.run

    import stagectl.torchrun

    roots: list[Path] = []

    def launch(args: object) -> None:  # torchrun's own set-up (its log specs make the log dir), no workers
        config, _, _ = torch.distributed.run.config_from_args(args)
        assert config.logs_specs is not None
        roots.append(Path(config.logs_specs.root_log_dir))

    temp_root = tmp_path / "tmp"
    temp_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp_root))
    monkeypatch.setattr(stagectl.torchrun, "die_with_parent", lambda: None)
    monkeypatch.setattr(torch.distributed.run, "run", launch)
    user_args = [f"--log-dir={tmp_path / 'mine'}"] if user_log_dir else []
    for _ in range(3):
        assert stagectl.torchrun.main(["--nproc-per-node=1", *user_args, "x.py"]) == 0
    assert len(roots) == 3
    if user_log_dir:
        assert roots == [tmp_path / "mine"] * 3 and roots[0].is_dir()
        assert list(temp_root.iterdir()) == []
    else:
        assert all(root.parent == temp_root for root in roots)  # torchrun's log dir was the temp one ...
        assert list(temp_root.iterdir()) == []  # ... and nothing of any launch is left
