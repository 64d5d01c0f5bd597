"""CLI latency: `stagectl --help` and `stagectl validate-config` on the tiny example (fresh processes),
next to a bare `python -c pass` (the interpreter start every command pays) and `import torch`.

Run: `python -m bench.bench_cli`. `run()` returns the numbers as a dict.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.common import interleaved_times_s, summary

ROOT = Path(__file__).parents[1]
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "stagectl --help": [sys.executable, "-m", "stagectl", "--help"],
    "stagectl validate-config": [
        sys.executable,
        "-m",
        "stagectl",
        "validate-config",
        "examples/tiny/train_ab.yaml",
    ],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
}


def _runner(argv: list[str]) -> object:
    return lambda: subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)


def run(repeats: int = 5) -> dict[str, object]:
    names = list(COMMANDS)
    times = interleaved_times_s([_runner(COMMANDS[n]) for n in names], repeats)
    out: dict[str, object] = {name: summary(t) for name, t in zip(names, times, strict=True)}
    base = summary(times[0])["median"]
    help_median = summary(times[1])["median"]
    out["help_over_bare_python"] = help_median / base
    out["torch_import_over_help"] = summary(times[3])["median"] / help_median
    return out


def main() -> None:
    results = run()
    for name, value in results.items():
        if isinstance(value, dict):
            print(
                f"{name:>28}: min {value['min']:.3f} s  median {value['median']:.3f} s  max {value['max']:.3f} s"
            )
        else:
            print(f"{name:>28}: {value:.2f}x")


if __name__ == "__main__":
    main()
