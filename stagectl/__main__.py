"""`python -m stagectl` runs the CLI.

A rank our launcher started (`STAGECTL_LAUNCHED`) that the launcher's forwarded Ctrl-C reaches while it is
still importing, before its command handles the signal itself, ends like one interrupted a moment later:
exit 0, so that torchrun does not report it as a failed rank (the launcher exits 130), and one line from
global rank 0 only (it was a KeyboardInterrupt traceback, `killed by SIGINT` and the line twice)."""

from __future__ import annotations

import os
import sys


def interrupted_line(argv: list[str]) -> str:
    """What global rank 0 says when the signal came during its imports."""
    command = next((arg for arg in argv[1:] if not arg.startswith("-")), "stagectl")
    if command == "train-ab":
        from stagectl.cli.train_ab import early_stop

        return early_stop()
    return f"{command}: interrupted (SIGINT) while starting; nothing new was saved"


def run() -> None:
    try:
        from stagectl.cli.app import main

        main()
    except KeyboardInterrupt:
        from stagectl.launch import LAUNCHED_ENV

        if os.environ.get(LAUNCHED_ENV) != "1":
            raise
        if os.environ.get("RANK", "0") == "0":
            print(interrupted_line(sys.argv), file=sys.stderr, flush=True)
        sys.exit(0)


if __name__ == "__main__":
    run()
