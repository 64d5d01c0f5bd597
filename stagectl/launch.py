"""Process launch: the torchrun argv (visible, logged) and the embedded rollout-server child."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from stagectl.config import StagectlConfig
from stagectl.config.model_data import DataConfig

LAUNCHED_ENV = "STAGECTL_LAUNCHED"
ROLLOUT_URLS_ENV = "STAGECTL_ROLLOUT_URLS"  # an embedded server's URL for the learner ranks (comma-separated)


def inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get(LAUNCHED_ENV) == "1"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now on `host` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def torchrun_argv(
    command_args: Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
) -> list[str]:
    """`python -m torch.distributed.run ... -m stagectl <command_args>`.

    Single node: `--standalone` rendezvous on a free (or the given) loopback port. Many nodes: a
    c10d rendezvous at `rdzv_endpoint` (run the same command on every node).
    """
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc_per_node}"]
    if nnodes > 1:
        if not rdzv_endpoint:
            raise ValueError("launch.nnodes > 1 needs launch.rdzv_endpoint (host:port of the rendezvous)")
        argv += [f"--nnodes={nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={rdzv_endpoint}"]
    else:
        port = master_port or free_port()
        argv += ["--nnodes=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
    return [*argv, "-m", "stagectl", *command_args]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a re-launched child: marks it launched so it never re-launches itself."""
    env = dict(os.environ)
    env[LAUNCHED_ENV] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    if extra:
        env.update(extra)
    return env


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
    config_path: Path, overrides: Sequence[str], cfg: StagectlConfig, timeout_s: float = 300.0
) -> Iterator[str]:
    """Start `stagectl rollout-server` as a child on a free loopback port, wait for /health/, yield its
    URL, and always stop it (normal exit, errors, Ctrl-C)."""
    from stagectl.rollout.launcher import start_server_process

    out = cfg.training.output_dir
    out.mkdir(parents=True, exist_ok=True)
    roots = [str(p.absolute()) for p in [*cfg.rollout_server.image_roots, *data_image_roots(cfg.data)]]
    args = [str(config_path), *(a for s in overrides for a in ("--set", s))]
    args += ["--set", f"rollout_server.image_roots={roots!r}"]
    args += ["--host", "127.0.0.1", "--port", "0", "--weights-dir", str((out / "weight_sync").absolute())]
    server = start_server_process(
        args, log_path=out / "rollout_server.log", timeout_s=timeout_s, env=child_env()
    )
    try:
        yield str(server.url)
    finally:
        server.stop()


def check_output_dir(output_dir: Path, key: str = "training.output_dir") -> None:
    """Fail before anything starts when the run directory cannot be written."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{key}: cannot write to {output_dir}: {exc.strerror or exc}") from None


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


def run_torchrun(argv: Sequence[str], env: dict[str, str]) -> int:
    """Run torchrun in its own session and wait for it. SIGTERM / Ctrl-C reach the ranks (not torchrun)
    as one SIGTERM each, so every rank finishes its step, saves and exits, and torchrun then exits with
    their status; a second signal is forwarded too (the ranks then stop at once). Nothing outlives us:
    if this process leaves early, the whole torchrun session is terminated."""
    proc = subprocess.Popen(list(argv), env=env, start_new_session=True)

    def forward(signum: int, frame: object) -> None:
        ranks = _children(proc.pid)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if not ranks:  # torchrun has not started its workers yet: stop it directly
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
