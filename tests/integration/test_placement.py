"""A train-ab run with an embedded server, learner and server pinned to disjoint CPUs: the affinity each
process really has (read from /proc while it runs) and the server's `CUDA_VISIBLE_DEVICES`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stagectl.launch import kill_tree
from tests.integration.helpers import ROOT, check_phase_times, read_metrics, tiny_train_config, write_config

HOST_CPUS = sorted(os.sched_getaffinity(0))


def _status(pid: int, field: str) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _thread_cpus(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of `pid`."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return set()
    return {cpus for task in tasks if (cpus := _status(int(task.name), "Cpus_allowed_list")) is not None}


def _server_child(pid: int) -> int | None:
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        for child in children:
            if b"rollout-server" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
    except OSError:
        return None
    return None


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs 2 CPUs to pin learner and server apart")
def test_learner_and_server_run_on_their_own_cpus(tmp_path: Path) -> None:
    learner_cpu, server_cpu = HOST_CPUS[0], HOST_CPUS[-1]
    out = tmp_path / "run"
    cfg = tiny_train_config(
        tmp_path,
        training={"max_steps": 4, "output_dir": str(out)},
        custom={"extra": {"rollout_matching": {"rollout_backend": "vllm", "max_new_tokens": 16}}},
        stage2_ab={"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "async"}},
        launch={"cpus": [learner_cpu]},
        rollout_server={"embedded": True, "cpus": [server_cpu], "devices": [3]},
    )
    # ids map through the launcher's own CUDA_VISIBLE_DEVICES (names no real GPU: the run stays on the CPU)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d"}
    argv = [sys.executable, "-m", "stagectl", "train-ab", str(write_config(tmp_path / "cfg.yaml", cfg))]
    log = (tmp_path / "stderr.txt").open("w+")  # a file, not a pipe: a full pipe would stall the run
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    seen: dict[str, str | None] = {"learner": None, "server": None, "server_cuda": None, "prefetcher": None}
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            learner = _status(proc.pid, "Cpus_allowed_list")
            if learner == str(learner_cpu):  # pinned once training starts (after the server listens)
                seen["learner"] = learner
                if str(server_cpu) in _thread_cpus(proc.pid):  # the prefetcher thread, on the server's CPU
                    seen["prefetcher"] = str(server_cpu)
            server = _server_child(proc.pid)
            if server is not None:
                seen["server"] = _status(server, "Cpus_allowed_list") or seen["server"]
                seen["server_cuda"] = _environ(server).get("CUDA_VISIBLE_DEVICES")
            if seen["prefetcher"] and seen["server"] == str(server_cpu):
                break
            time.sleep(0.05)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid, grace_s=5.0)
        log.close()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 0, stderr[-4000:]
    assert seen == {
        "learner": str(learner_cpu),
        "server": str(server_cpu),
        "server_cuda": "GPU-d",
        "prefetcher": str(server_cpu),  # launch.prefetcher_cpus: server (the default)
    }
    assert f"learner rank 0 on CPU(s) [{learner_cpu}], 1 torch thread(s)" in stderr
    rows = read_metrics(out)
    assert any(r["kind"] == "B" for r in rows)
    check_phase_times(rows)


def _descendants(pid: int) -> list[int]:
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            for task in Path(f"/proc/{parent}/task").iterdir():
                children = [int(c) for c in (task / "children").read_text().split()]
                found += children
                queue += children
        except OSError:
            continue
    return found


@pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs 2 CPUs for 2 pinned ranks")
def test_torchrun_ranks_get_their_cpu_slices_and_the_learner_devices(tmp_path: Path) -> None:
    """Two A-only ranks under torchrun (`--nproc 2`, the integration tier's one plain 2-rank A-only run):
    `launch.cpus` split one CPU per rank, `launch.devices` in every rank's environment (mapped through the
    launcher's CUDA_VISIBLE_DEVICES, which names no real GPU); the ranks end with identical weights, and
    `model.attn_implementation` is read by the learner (named in its start-up line)."""
    out = tmp_path / "run"
    cfg = tiny_train_config(
        tmp_path,
        training={"max_steps": 3, "output_dir": str(out)},
        stage2_ab={"schedule": {"b_ratio": 0.0}, "channel_b": {"mode": "step"}},
        launch={"cpus": HOST_CPUS[:2], "devices": [1, 0]},
    )
    cfg["model"]["attn_implementation"] = "eager"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}
    config = str(write_config(tmp_path / "cfg.yaml", cfg))
    argv = [sys.executable, "-m", "stagectl", "train-ab", config, "--nproc", "2"]
    log = (tmp_path / "stderr.txt").open("w+")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    # each rank's (CPUs, CUDA_VISIBLE_DEVICES) as it changed: a rank starts with the launcher's CPUs and
    # pins itself once training starts, so its last value is its placement (the trail names the pids)
    last: dict[str, tuple[str, str | None]] = {}
    trail: list[tuple[int, str, str, str | None]] = []
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in _descendants(proc.pid):
                try:
                    environ = _environ(pid)
                except OSError:
                    continue
                rank = environ.get("RANK")  # a torchrun worker (the agent has none)
                cpus = _status(pid, "Cpus_allowed_list")
                if rank is None or cpus is None:
                    continue
                now = (cpus, environ.get("CUDA_VISIBLE_DEVICES"))
                if last.get(rank) != now:
                    last[rank] = now
                    trail.append((pid, rank, *now))
            time.sleep(0.05)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid, grace_s=5.0)
        log.close()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 0, stderr[-4000:]
    expected = {"0": (str(HOST_CPUS[0]), "GPU-b,GPU-a"), "1": (str(HOST_CPUS[1]), "GPU-b,GPU-a")}
    assert last == expected, f"observed (pid, RANK, CPUs, CUDA_VISIBLE_DEVICES) in order: {trail}"
    # moved here from test_train_ab.py's `test_two_ranks_a_only_end_with_identical_weights` (one run)
    assert "attention eager (vision: eager)" in stderr
    assert "launching: " in stderr and "stagectl.torchrun" in stderr
    digests = json.loads((out / "final_state.json").read_text())["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    rows = read_metrics(out)
    assert [r["kind"] for r in rows] == ["A", "A", "A"]
    assert rows[0]["packing/n_packs"] == 2  # one packed sequence per rank, summed over ranks
    assert rows[0]["packing/n_segments"] >= 4
