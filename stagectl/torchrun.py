"""`python -m stagectl.torchrun ARGS`: torchrun (`torch.distributed.run`, unchanged arguments) as the
stagectl launcher runs it.

- It dies with the launcher, even when the launcher is SIGKILLed (`launch.die_with_parent`); each
  rank's watchdog then ends the rank.
- A run that fails ends with one line per failed rank (exit code or signal, and what it means)
  instead of torchrun's `ChildFailedError` traceback; the ranks have printed their own errors above.
- torchrun's per-launch log directory (`--log-dir`, default a fresh `/tmp/torchelastic_*` that torch never
  removes: one left behind per launch) is a temp directory of this process, removed when torchrun ends,
  unless `--log-dir` names one.
- A node that loses the rendezvous store (multi-node: the node that hosts it, the first to start at
  the endpoint, died or the network broke) says so in one line; torch's C++ warnings about the broken
  store socket (each with a 30-frame backtrace) are not printed by this process (`TORCH_CPP_LOG_LEVEL`
  is left as the user set it for the ranks).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from stagectl.launch import die_with_parent
from stagectl.watchdog import ORPHAN_EXIT_CODE, WATCHDOG_EXIT_CODE


def describe_exit(exitcode: int) -> str:
    """What a rank's exit code means, in words."""
    if exitcode == WATCHDOG_EXIT_CODE:
        return f"exit code {exitcode}: its watchdog ended it (the phase is named above)"
    if exitcode == ORPHAN_EXIT_CODE:
        return f"exit code {exitcode}: its launcher was gone"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}"
    return f"exit code {exitcode}"


def failure_lines(failures: dict[int, Any]) -> list[str]:
    """One line per failed rank, first failure first (`failures`: torchrun's rank -> ProcessFailure). Once
    a rank fails, torchrun SIGTERMs the others: those come after the ranks that failed on their own and say
    so (their timestamps may come first: they were read when torchrun reaped them)."""
    ordered = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    stopped = -int(signal.SIGTERM)
    cause = next((rank for rank, f in ordered if f.exitcode != stopped), None)
    if cause is not None:
        ordered.sort(key=lambda item: item[1].exitcode == stopped)  # stable: the causes first
    lines = []
    for rank, f in ordered:
        what = describe_exit(f.exitcode)
        if cause is not None and f.exitcode == stopped:
            what = f"stopped by torchrun (SIGTERM) after rank {cause} failed"
        lines.append(f"torchrun: rank {rank} (local rank {f.local_rank}, pid {f.pid}) failed: {what}")
    return lines


def store_lost_line(endpoint: str, exc: BaseException) -> str:
    """The one line a node prints when its rendezvous store connection broke."""
    return (
        f"torchrun: lost the rendezvous store at {endpoint or '(local)'}: the node hosting it (the first "
        f"node started at that endpoint) died or the network broke; this node's ranks were stopped "
        f"({type(exc).__name__})"
    )


def _import_torch_quietly() -> None:
    """Import torch with its C++ log level at ERROR for this process only: c10 reads
    `TORCH_CPP_LOG_LEVEL` once, when it loads, and the ranks inherit the user's setting."""
    user = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        import torch  # noqa: F401
    finally:
        if user is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = user


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent()
    _import_torch_quietly()
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.log_dir:
        return _run(run, args)
    # torchrun would make a /tmp/torchelastic_* of its own (the ranks' error files) and leave it behind
    with tempfile.TemporaryDirectory(prefix="stagectl-torchelastic-", ignore_cleanup_errors=True) as log_dir:
        args.log_dir = log_dir
        return _run(run, args)


def _run(run: Callable[[Any], object], args: Any) -> int:
    """torchrun's `run(args)`, its failures as the one-line messages of the module docstring."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError

    try:
        run(args)
    except ChildFailedError as exc:
        for line in failure_lines(exc.failures):
            print(line, file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        print(f"torchrun: stopped by {exc.sigval.name}", file=sys.stderr, flush=True)
        return 1
    except RendezvousConnectionError as exc:
        print(store_lost_line(args.rdzv_endpoint, exc), file=sys.stderr, flush=True)
        return 1
    except (RendezvousError, RuntimeError, OSError) as exc:  # rendezvous, store or port trouble
        text = str(exc).strip().splitlines()
        print(f"torchrun: {type(exc).__name__}: {text[0] if text else ''}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
