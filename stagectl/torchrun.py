"""`python -m stagectl.torchrun ARGS`: torchrun (`torch.distributed.run`, unchanged arguments) as the
stagectl launcher runs it.

- It dies with the launcher, even when the launcher is SIGKILLed (`launch.die_with_parent`); each
  rank's watchdog then ends the rank.
- A run that fails ends with one line per failed rank (exit code or signal, and what it means)
  instead of torchrun's `ChildFailedError` traceback; the ranks have printed their own errors above.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
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
    """One line per failed rank, first failure first (`failures`: torchrun's rank -> ProcessFailure)."""
    ordered = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    return [
        f"torchrun: rank {rank} (local rank {f.local_rank}, pid {f.pid}) failed: {describe_exit(f.exitcode)}"
        for rank, f in ordered
    ]


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as exc:
        for line in failure_lines(exc.failures):
            print(line, file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        print(f"torchrun: stopped by {exc.sigval.name}", file=sys.stderr, flush=True)
        return 1
    except (RendezvousError, RuntimeError, OSError) as exc:  # rendezvous, store or port trouble
        text = str(exc).strip().splitlines()
        print(f"torchrun: {type(exc).__name__}: {text[0] if text else ''}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
