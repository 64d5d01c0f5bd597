"""The pieces a report is made of (plain data): plots written, plots skipped with the reason, and
the whole report of one run as the writer hands it to the markdown renderer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Plot:
    file: str  # file name under the report's plot dir
    title: str
    caption: str


@dataclass(frozen=True)
class Skipped:
    what: str
    reason: str


@dataclass
class Figures:
    plots: list[Plot] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def add(self, item: Plot | Skipped) -> None:
        if isinstance(item, Plot):
            self.plots.append(item)
        else:
            self.skipped.append(item)
