"""`stagectl.files`: run files (config.yaml, final_state, reports) get the mode a plain `open` gives them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from stagectl.files import atomic_write_text, check_output_dir, follow_umask, write_resolved_config


def test_resolved_config_follows_the_umask_not_mkstemps_0600(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        path = write_resolved_config(tmp_path / "run", {"model": {"name_or_path": "x"}})
        atomic_write_text(tmp_path / "note.txt", "ok\n")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "note.txt").stat().st_mode) == 0o644
    assert path.read_text().startswith("model:") and (tmp_path / "note.txt").read_text() == "ok\n"


def test_the_write_check_leaves_no_directory_behind(tmp_path: Path) -> None:
    check_output_dir(tmp_path / "a" / "b" / "run")
    assert os.listdir(tmp_path) == []
    (tmp_path / "existing").mkdir()
    check_output_dir(tmp_path / "existing")
    assert os.listdir(tmp_path / "existing") == []


def test_follow_umask_opens_up_a_library_written_tree(tmp_path: Path) -> None:
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    for path in (model / "model.safetensors", model / "sub" / "x.json"):
        path.write_text("x")
        path.chmod(0o600)
    model.chmod(0o700)
    umask = os.umask(0o022)
    try:
        follow_umask(model)
    finally:
        os.umask(umask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in (model, model / "sub")} == {0o755}
    assert {stat.S_IMODE(p.stat().st_mode) for p in model.rglob("*") if p.is_file()} == {0o644}


def test_a_staging_directory_of_another_host_sharing_the_filesystem_is_left_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export (or report) on another machine writing beside OUT on a shared filesystem (NFS) has a pid
    that means nothing here: its staging directory was removed under it while it wrote its weights."""
    import socket

    import stagectl.files as files

    monkeypatch.setattr(socket, "gethostname", lambda: "node-b.cluster")
    theirs = files.make_staging_dir(tmp_path, ".model.")
    (theirs / "model.safetensors").write_bytes(b"weights being written")
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a.cluster")
    monkeypatch.setattr(files, "pid_alive", lambda pid: False)  # their pid is no process on this host
    ours = files.make_staging_dir(tmp_path, ".model.")
    assert (theirs / "model.safetensors").is_file()
    killed = ours.with_name(ours.name.replace(f".model.{os.getpid()}-", ".model.111-", 1))
    ours.rename(killed)  # this host's, its process gone: removed by the next
    files.make_staging_dir(tmp_path, ".model.")
    assert not killed.exists() and theirs.is_dir()
