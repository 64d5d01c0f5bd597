"""Bench only (`bench.bench_samples`): on `PYTHONPATH`, every process of a run imports this, which
patches the learner's per-step `samples.jsonl` gather and write (`Trainer._log_samples`):

- `STAGECTL_BENCH_SAMPLES=off`: a no-op (the "without the audit trail" side);
- `STAGECTL_BENCH_SAMPLES=time:DIR`: timed; each rank appends the seconds of each call to
  `DIR/rank<R>.txt`.

Never on the product's path."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

TARGET = "stagectl.learner.loop"
MODE = os.environ.get("STAGECTL_BENCH_SAMPLES", "")


def _patch(module: ModuleType) -> None:
    cls = module.Trainer
    if MODE == "off":
        cls._log_samples = lambda self, step, records: None
        return
    out = Path(MODE.removeprefix("time:")) / f"rank{os.environ.get('RANK', '0')}.txt"
    original = cls._log_samples

    def timed(self: Any, step: int, records: Any) -> None:
        started = time.perf_counter()
        original(self, step, records)
        with out.open("a") as handle:
            handle.write(f"{time.perf_counter() - started}\n")

    cls._log_samples = timed


class _Hook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self._loader: Any = None

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _patch(module)


if MODE:
    sys.meta_path.insert(0, _Hook())
