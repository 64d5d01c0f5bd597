"""`python -m stagectl` (`stagectl.__main__`): a rank our launcher started that a Ctrl-C reaches during its
imports exits 0 (torchrun does not call it failed) with one line from global rank 0 only; outside the
launcher the interrupt is left alone."""

from __future__ import annotations

from typing import NoReturn

import pytest

import stagectl.__main__ as entry
import stagectl.cli.app


def _interrupted() -> NoReturn:
    raise KeyboardInterrupt  # as if the signal came while the CLI was imported


@pytest.mark.parametrize(
    ("rank", "argv", "line"),
    [
        (
            "0",
            ["stagectl", "train-ab", "cfg.yaml", "--plan", "p.json"],
            "train-ab: interrupted (SIGINT) before its first step; nothing new was saved\n",
        ),
        ("1", ["stagectl", "train-ab", "cfg.yaml", "--plan", "p.json"], ""),
        (
            "0",
            ["stagectl", "stage-b", "cfg.yaml"],
            "stage-b: interrupted (SIGINT) while starting; nothing new was saved\n",
        ),
    ],
)
def test_a_launched_rank_interrupted_while_it_imports_exits_0_and_rank_0_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], rank: str, argv: list[str], line: str
) -> None:
    monkeypatch.setattr(stagectl.cli.app, "main", _interrupted)
    monkeypatch.setattr(entry.sys, "argv", argv)
    monkeypatch.setenv("STAGECTL_LAUNCHED", "1")
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as ended:
        entry.run()
    assert ended.value.code == 0
    assert capsys.readouterr().err == line


def test_outside_the_launcher_the_interrupt_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stagectl.cli.app, "main", _interrupted)
    monkeypatch.delenv("STAGECTL_LAUNCHED", raising=False)
    with pytest.raises(KeyboardInterrupt):
        entry.run()
