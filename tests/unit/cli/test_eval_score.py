"""`stagectl eval --score`: it sets `data.eval.score`, and a kind that is not one is refused before any
work with the key and the choices named."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from stagectl.cli.app import app

CONFIG = Path(__file__).parents[3] / "examples" / "tiny" / "learn_shapes.yaml"


def test_an_unknown_score_kind_is_refused_naming_the_key(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["eval", str(CONFIG), "--out", str(tmp_path / "out"), "--score", "box"])
    assert result.exit_code == 1
    assert "data.eval.score" in result.output and "objectness_coord_desc" in result.output
    assert not (tmp_path / "out").exists()  # nothing written
