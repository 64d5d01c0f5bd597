"""Bench only (`bench.bench_samples`): on `PYTHONPATH`, every process of a run imports this and the
learner's per-step `samples.jsonl` gather and write become a no-op: the "without the audit trail"
side of the overhead measurement. Never on the product's path."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

TARGET = "stagectl.learner.loop"


class _NoSamples(importlib.abc.MetaPathFinder, importlib.abc.Loader):
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
        module.Trainer._log_samples = lambda self, step, records: None


sys.meta_path.insert(0, _NoSamples())
