"""`python -m bench.cross_core --help` prints its usage; it used to start the benchmark (any argument but its
own internal `--train` was ignored)."""

from __future__ import annotations

import pytest

from bench import cross_core


def test_help_prints_usage_and_runs_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(repeats: int) -> list[float]:
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(cross_core, "decode_times", refuse)
    with pytest.raises(SystemExit) as exited:
        cross_core.main(["--help"])
    assert exited.value.code == 0
    assert "usage: python -m bench.cross_core" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        cross_core.main(["--bogus"])
    assert exited.value.code == 2
