"""`stagectl tiny-model`: an OUT under a file is refused naming the file (it was a NotADirectoryError
traceback); a build that fails leaves neither OUT nor its staging directory behind. In process."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stagectl.cli.app import app


def tiny_model(out: Path, *args: str) -> tuple[int, str, BaseException | None]:
    result = CliRunner().invoke(app, ["tiny-model", str(out), *args])
    return result.exit_code, result.output, result.exception


def test_an_out_under_a_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    code, output, exception = tiny_model(tmp_path / "afile" / "sub")
    assert code == 1 and isinstance(exception, SystemExit), output
    assert (
        f"error: OUT: cannot write to {tmp_path / 'afile' / 'sub'}: {tmp_path / 'afile'} is a file" in output
    )


def test_a_failed_build_leaves_no_partial_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import stagectl.models.tiny as tiny

    def build_then_fill_the_disk(arch: str, out_dir: Path) -> Path:
        (Path(out_dir) / "config.json").write_text("{}")  # what a build writes before the disk fills
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tiny, "build_tiny_model", build_then_fill_the_disk)
    out = tmp_path / "models" / "tiny"
    code, output, _ = tiny_model(out)
    assert code == 1
    assert f"error: OUT: cannot write the model to {out}: No space left on device" in output
    assert list((tmp_path / "models").iterdir()) == []  # no OUT, no staging directory


def test_the_model_files_get_the_umasks_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """save_pretrained stages model.safetensors with mkstemp (0600): other users (a vLLM server, a job under
    another account) could not read the model tiny-model wrote."""
    import os

    import stagectl.models.tiny as tiny

    def build_as_save_pretrained_does(arch: str, out_dir: Path) -> Path:
        weights = Path(out_dir) / "model.safetensors"
        weights.write_bytes(b"weights")
        os.chmod(weights, 0o600)
        return Path(out_dir)

    monkeypatch.setattr(tiny, "build_tiny_model", build_as_save_pretrained_does)
    old = os.umask(0o022)
    try:
        code, output, _ = tiny_model(tmp_path / "tiny")
    finally:
        os.umask(old)
    assert code == 0, output
    assert (tmp_path / "tiny" / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_a_build_removes_the_staging_directory_a_killed_one_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGKILL skips the clean-up: the half-built model stayed next to OUT as a hidden staging directory,
    one more on every killed try (for `export`, a whole model's weights each). The next build removes a dead
    process's, never a live one's (another build of the same OUT)."""
    import stagectl.files as files
    import stagectl.models.tiny as tiny

    monkeypatch.setattr(files, "pid_alive", lambda pid: pid == 222)
    monkeypatch.setattr(tiny, "build_tiny_model", lambda arch, out_dir: Path(out_dir))
    host = files.host_tag()  # this host's: another's are left to it (a shared filesystem)
    killed, live = tmp_path / f".tiny.111-{host}-abc", tmp_path / f".tiny.222-{host}-xyz"
    for left in (killed, live):
        left.mkdir()
        (left / "model.safetensors").write_bytes(b"half the weights")
    code, output, _ = tiny_model(tmp_path / "tiny")
    assert code == 0, output
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "tiny"]
