"""`stagectl export`: an OUT that cannot be a directory is refused naming why, before the model loads (it was
a FileExistsError / NotADirectoryError traceback after loading it). In process."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from stagectl.cli.app import app


@pytest.mark.parametrize("under", ["sub", "sub/deeper"])
def test_an_out_under_a_file_names_the_file(tmp_path: Path, under: str) -> None:
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / under
    result = CliRunner().invoke(app, ["export", "builtin:tiny-qwen2.5-vl", str(out)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert (
        f"error: OUT: cannot write to {out}: {tmp_path / 'afile'} is a file, not a directory" in result.output
    )


def test_an_out_that_holds_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("mine")
    result = CliRunner().invoke(app, ["export", "builtin:tiny-qwen2.5-vl", str(tmp_path)])
    assert result.exit_code == 1
    assert f"error: {tmp_path} exists and is not an empty directory; choose a new path" in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["x"]


def test_a_lora_adapter_dir_names_the_checkpoint_to_export(tmp_path: Path) -> None:
    """train-ab's checkpoint-N/adapter/ was answered "is not a model checkpoint: it has no config.json"."""
    checkpoint = tmp_path / "run" / "checkpoint-2"
    (checkpoint / "adapter").mkdir(parents=True)
    (checkpoint / "adapter" / "adapter_config.json").write_text("{}")
    (checkpoint / "model").mkdir()
    (checkpoint / "model" / "config.json").write_text("{}")
    result = CliRunner().invoke(app, ["export", str(checkpoint / "adapter"), str(tmp_path / "out")])
    assert result.exit_code == 1
    assert (
        f"is a LoRA adapter (adapter_config.json, no config.json), not a model: export the checkpoint it belongs "
        f"to, whose model/ holds the merged weights: stagectl export {checkpoint} OUT"
    ) in result.output
    assert not (tmp_path / "out").exists()
