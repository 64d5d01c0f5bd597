"""Process launch: the torchrun argv (visible, logged) and the embedded rollout-server child."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from stagectl.config.model_data import DataConfig
from stagectl.config.rollout import RolloutServerConfig
from stagectl.config.training import LaunchConfig
from stagectl.watchdog import LAUNCHER_PID_ENV

LAUNCHED_ENV = "STAGECTL_LAUNCHED"
RUN_ID_ENV = "STAGECTL_RUN_ID"
EXIT_WITH_PARENT_ENV = "STAGECTL_EXIT_WITH_PARENT"  # "PID:SIGNAL": die with that parent (Linux)
KILL_GRACE_S = 3.0  # after a rank's watchdog fired: SIGTERM the node's ranks, SIGKILL what is left then
PLAN_DIR_PREFIX = "stagectl-plan-"  # + the launcher's pid + "-" + tempfile's suffix
ORPHAN_PLAN_DIR_AGE_S = 600.0  # a dead launcher's plan dir is removed once it is this old


def inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get(LAUNCHED_ENV) == "1"


# torchrun's per-rank variables: a rank reads its world from them (`stagectl.dist.read_world`)
RANK_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def as_the_only_rank() -> None:
    """The launcher runs a one-rank world in its own process: torchrun's rank variables left in its
    environment by another job (an exported `WORLD_SIZE=2`) describe no world of this run, and the rank would
    read them (a plan for 1 rank refused as "this run has 2", or a process-group rendezvous without a
    `RANK`). They are removed; a rank torchrun started keeps its own."""
    if inside_torchrun():
        return
    for name in RANK_ENV:
        os.environ.pop(name, None)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now on `host` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def run_id_for(nnodes: int, rdzv_id: str | None, rdzv_endpoint: str | None) -> str:
    """The rendezvous id: the configured one; for many nodes one every node derives alike from what
    they share, the endpoint (their run directories may be node-local); for one node a fresh random id.
    On a scheduler, set `launch.rdzv_id` to the job id so two jobs on one endpoint never mix."""
    if rdzv_id:
        return rdzv_id
    if nnodes > 1:
        return f"stagectl-{hashlib.sha256(str(rdzv_endpoint).encode()).hexdigest()[:16]}"
    return f"stagectl-{uuid.uuid4().hex[:16]}"


def torchrun_argv(
    command_args: Sequence[str],
    *,
    nproc_per_node: int,
    run_id: str,
    nnodes: int = 1,
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
) -> list[str]:
    """`python -m stagectl.torchrun ... -m stagectl <command_args>` (torchrun with stagectl's exit rules).

    One node: a c10d rendezvous on 127.0.0.1, on `master_port` or on port 0 (the rendezvous binds a free
    port itself, so two runs can never race for one), and the node's address pinned to loopback. Many
    nodes: the c10d rendezvous at `rdzv_endpoint`, the same command on every node.
    """
    argv = [
        sys.executable,
        "-m",
        "stagectl.torchrun",
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-id={run_id}",
        "--max-restarts=0",
    ]
    if nnodes > 1:
        if not rdzv_endpoint:
            raise ValueError("launch.nnodes > 1 needs launch.rdzv_endpoint (host:port of the rendezvous)")
        argv.append(f"--rdzv-endpoint={rdzv_endpoint}")
    else:
        argv += [f"--rdzv-endpoint=127.0.0.1:{master_port or 0}", "--local-addr=127.0.0.1"]
    return [*argv, "-m", "stagectl", *command_args]


def child_env(extra: dict[str, str] | None = None, *, single_node: bool = True) -> dict[str, str]:
    """Environment of a re-launched child: marks it launched so it never re-launches itself; on one
    node, gloo and NCCL sockets stay on loopback (otherwise they bind the hostname's interface)."""
    env = dict(os.environ)
    env[LAUNCHED_ENV] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    if single_node:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if extra:
        env.update(extra)
    return env


def die_with_parent() -> None:
    """Honour `STAGECTL_EXIT_WITH_PARENT=PID:SIGNAL` (set by the launcher for its children): receive
    SIGNAL when the parent dies, even by SIGKILL (Linux `PR_SET_PDEATHSIG`); if the parent is already
    gone, receive it now."""
    spec = os.environ.pop(EXIT_WITH_PARENT_ENV, "")
    pid_text, _, sig_text = spec.partition(":")
    if not pid_text.isdigit() or not sig_text.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(sig_text), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != int(pid_text):  # the parent died before the prctl took effect
        os.kill(os.getpid(), int(sig_text))


def data_image_roots(data: DataConfig | None) -> list[Path]:
    """Directories the training images live in (what an embedded rollout server may read)."""
    if data is None:
        return []
    if data.synthetic is not None:
        from stagectl.data.synthetic import default_synthetic_dir, synthetic_params

        syn = data.synthetic
        params = synthetic_params(syn.num_samples, syn.seed, **syn.generator_kwargs(), split="train")
        return [default_synthetic_dir(params)]
    assert data.train_jsonl is not None
    return [Path(data.image_root) if data.image_root else Path(data.train_jsonl).parent]


@contextmanager
def embedded_rollout_server(
    config_path: Path,
    overrides: Sequence[str],
    server: RolloutServerConfig,
    data: DataConfig | None,
    output_dir: Path,
    timeout_s: float = 300.0,
    *,
    weights_dir: Path | None = None,
) -> Iterator[str]:
    """Start `stagectl rollout-server` as a child on a free loopback port, wait for /health/, yield its
    URL, and always stop it, last (normal exit, errors, Ctrl-C). The child runs in its own session and
    reads the same YAML and `overrides` (it resolves its own `ServerPlan`), may read the training images
    (`data`'s and `server.image_roots`), loads disk weight syncs from `weights_dir` (the disk transport's
    `disk_dir`; None for the other transports, which read no snapshot), and logs to
    `output_dir/rollout_server.log`."""
    from stagectl.server.launcher import ServerKeeper, start_server_process

    output_dir.mkdir(parents=True, exist_ok=True)
    if weights_dir is not None:  # the learner writes its first snapshot there later; the server checks it now
        weights_dir.mkdir(parents=True, exist_ok=True)
    roots = [str(p.absolute()) for p in [*server.image_roots, *data_image_roots(data)]]

    def args_for_port(port: int) -> list[str]:
        args = [str(config_path), *(a for s in overrides for a in ("--set", s))]
        args += ["--set", f"rollout_server.image_roots={roots!r}"]
        args += ["--host", "127.0.0.1", "--port", str(port)]
        if weights_dir is not None:
            args += ["--weights-dir", str(weights_dir.absolute())]
        return [*args, "--access-log", "-"]  # its output goes to rollout_server.log, not to the terminal

    from stagectl.placement import cuda_env

    devices = cuda_env("rollout_server.devices", server.devices)
    env = child_env({EXIT_WITH_PARENT_ENV: f"{os.getpid()}:{int(signal.SIGTERM)}", **devices})
    log_path = output_dir / "rollout_server.log"
    # in its own session: a terminal's Ctrl-C reaches the launcher only, the learners finish their step
    # against a live server and the launcher stops it last (below)
    child = start_server_process(
        args_for_port(0), log_path=log_path, timeout_s=timeout_s, env=env, new_session=True
    )
    # a server that crashes is started again on its port (the learner re-syncs it)
    keeper = ServerKeeper(
        child,
        args_for_port,
        max_restarts=server.embedded_max_restarts,
        env=env,
        log_path=log_path,
        timeout_s=timeout_s,
        new_session=True,
    )
    try:
        yield str(child.url)
    finally:
        keeper.stop()


def relaunch_under_torchrun(
    command_args: Sequence[str], launch: LaunchConfig, *, on_signal: Callable[[int], None] | None = None
) -> int:
    """Re-run `stagectl COMMAND_ARGS` under torchrun as `launch` says (argv printed first); returns the
    exit code. `on_signal`: see `run_torchrun`."""
    run_id = run_id_for(launch.nnodes, launch.rdzv_id, launch.rdzv_endpoint)
    argv = torchrun_argv(
        command_args,
        nproc_per_node=launch.nproc_per_node,
        run_id=run_id,
        nnodes=launch.nnodes,
        master_port=launch.master_port,
        rdzv_endpoint=launch.rdzv_endpoint,
    )
    from stagectl.placement import cuda_env

    devices = cuda_env("launch.devices", launch.devices)  # every rank sees the node's learner devices
    print(f"launching: {shlex.join(argv)}", file=sys.stderr, flush=True)
    env = child_env({RUN_ID_ENV: run_id, **devices}, single_node=launch.nnodes == 1)
    return run_torchrun(argv, env, on_signal=on_signal)


@contextmanager
def plan_dir() -> Iterator[Path]:
    """A private temp dir for the plan file torchrun's ranks read, removed when the block ends. Its name
    carries this launcher's pid: a launcher that could not clean up (SIGKILL) leaves its dir behind, and
    the next launch removes it (`remove_orphan_plan_dirs`)."""
    remove_orphan_plan_dirs(Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix=f"{PLAN_DIR_PREFIX}{os.getpid()}-") as tmp:
        yield Path(tmp)


def remove_orphan_plan_dirs(root: Path, *, min_age_s: float = ORPHAN_PLAN_DIR_AGE_S) -> list[Path]:
    """Remove this user's plan dirs under `root` whose launcher is gone (its pid runs no process) and
    that are older than `min_age_s`; returns them. Does nothing where /proc cannot tell (not Linux)."""
    if not Path("/proc/self/stat").exists():
        return []
    removed: list[Path] = []
    now = time.time()
    for path in root.glob(f"{PLAN_DIR_PREFIX}*-*"):
        pid = path.name.removeprefix(PLAN_DIR_PREFIX).split("-", 1)[0]
        try:
            st = path.lstat()
        except OSError:
            continue
        if not (pid.isdigit() and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()):
            continue  # not a plan dir of ours (a symlink, another user's, another naming)
        if now - st.st_mtime <= min_age_s or _running(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def run_torchrun(
    argv: Sequence[str], env: dict[str, str], *, on_signal: Callable[[int], None] | None = None
) -> int:
    """Run torchrun in its own session and supervise it until it exits; returns its exit code.

    - SIGTERM / Ctrl-C reach the ranks (not torchrun) as one SIGTERM each, so every rank finishes its
      step, saves and exits, and torchrun then exits with their status; a second signal is forwarded
      too (the ranks then stop at once). With `on_signal` (for ranks that handle both signals and name
      the one they got), each rank gets the signal as received (Ctrl-C stays SIGINT) and
      `on_signal(signum)` is called in the handler (the launcher exits 128 + it).
    - A rank whose watchdog fired sends us SIGUSR1: every rank of this node gets SIGTERM and, after
      `KILL_GRACE_S`, SIGKILL (a rank frozen by SIGSTOP, or blocked in a collective, ends too).
    - torchrun dies with us, even when we are SIGKILLed (PR_SET_PDEATHSIG), and each rank's watchdog
      ends the rank when torchrun is gone. If we leave early for any other reason, the whole session
      (torchrun and every rank) is terminated here.
    """
    env = {
        **env,
        LAUNCHER_PID_ENV: str(os.getpid()),
        EXIT_WITH_PARENT_ENV: f"{os.getpid()}:{int(signal.SIGKILL)}",
    }
    proc = subprocess.Popen(list(argv), env=env, start_new_session=True)
    abort_at: list[float] = []

    def forward(signum: int, frame: object) -> None:
        if on_signal is not None:
            on_signal(signum)
        ranks = _descendants(proc.pid)
        for pid in ranks:
            _signal(pid, signum if on_signal is not None else signal.SIGTERM)
        if not ranks:  # torchrun has not started its workers yet: stop it directly
            _signal(proc.pid, signal.SIGTERM)

    def on_watchdog(signum: int, frame: object) -> None:
        if not abort_at:
            abort_at.append(time.monotonic())
            for pid in _descendants(proc.pid):
                _signal(pid, signal.SIGTERM)

    handlers = {signal.SIGTERM: forward, signal.SIGINT: forward, signal.SIGUSR1: on_watchdog}
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        while True:
            try:
                return proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if abort_at and time.monotonic() - abort_at[0] > KILL_GRACE_S:
                for pid in _descendants(proc.pid):
                    _signal(pid, signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            kill_tree(proc.pid, grace_s=10.0)
            proc.wait()


def kill_tree(root: int, *, grace_s: float) -> None:
    """SIGTERM `root` and every descendant (whatever their session), SIGKILL what is left after `grace_s`."""
    pids = [*_descendants(root), root]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Every descendant of `pid` (children first), read from /proc (empty elsewhere or when gone)."""
    found: list[int] = []
    queue = [pid]
    while queue:
        for child in _children(queue.pop()):
            found.append(child)
            queue.append(child)
    return found


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc; empty elsewhere or when it is gone)."""
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text()
            found += [int(p) for p in text.split()]
    except OSError:
        return []
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
