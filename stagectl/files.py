"""Files every command writes the same way: atomic replacement, the writable-output check made before
anything starts, and the resolved config (`config.yaml` in the run directory, for every command)."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from stagectl.watchdog import pid_alive

RESOLVED_CONFIG = "config.yaml"


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that readers see either the old or the new content (the mode a plain
    `open` would give it: see `atomic_write_lines`)."""
    atomic_write_lines(path, [text])


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """`atomic_write_text` for bytes (a plot rendered into memory)."""
    _replace(path, data)


def atomic_write_lines(path: Path, lines: Iterable[str]) -> None:
    """Stream `lines` (each with its newline) into a temp file next to `path` and rename it over `path`:
    whole or absent, also when producing a line fails midway. The file gets the mode a plain `open`
    would give it (0666 less the umask), not the temp file's 0600: data files are read by others."""
    _replace(path, lines)


def _replace(path: Path, content: bytes | Iterable[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    done = False
    try:
        if isinstance(content, bytes):
            with os.fdopen(fd, "wb") as binary:
                binary.write(content)
                binary.flush()
                os.fsync(binary.fileno())
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.writelines(content)
                handle.flush()
                os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        done = True
    finally:
        if not done:
            tmp.unlink(missing_ok=True)


def check_output_dir(output_dir: Path, key: str = "training.output_dir") -> None:
    """Fail before anything starts when the run directory cannot be written. Leaves the disk as it found it:
    directories made for the probe are removed again (the run creates its directory when it first writes),
    so a start that fails later leaves no empty run directory behind."""
    missing = [p for p in (output_dir, *output_dir.parents) if not p.exists()]  # innermost first
    existing = next((p for p in (output_dir, *output_dir.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():  # mkdir would say only "[Errno 20] Not a directory"
        raise ValueError(f"{key}: cannot write to {output_dir}: {existing} is a file, not a directory")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{key}: cannot write to {output_dir}: {exc.strerror or exc}") from None
    finally:
        for made in missing:
            with contextlib.suppress(OSError):  # another process may have written into it meanwhile
                made.rmdir()


def check_new_output_dir(out: Path, key: str) -> None:
    """`check_output_dir` for a directory a command fills whole (an export, a built model): it must be new or
    empty, since its files would mix with another model's."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory; choose a new path")
    check_output_dir(out, key)


def cwd_note(path: Path) -> str:
    """For a path that is not there: where a relative one was looked for (the working directory, not the
    config's directory: a command started from elsewhere misses it); empty for an absolute path."""
    return (
        "" if path.is_absolute() else f" (relative paths are read from the working directory, {Path.cwd()})"
    )


def make_output_dir(parent: Path, prefix: str) -> Path:
    """`tempfile.mkdtemp` in `parent` with the mode a plain `mkdir` gives (0777 less the umask), not
    mkdtemp's 0700: a staged directory renamed into place is read by other users (vLLM servers, jobs)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o777 & ~_umask())
    return path


def make_staging_dir(parent: Path, prefix: str) -> Path:
    """`make_output_dir(parent, "<prefix><pid>-<host>-")` for a directory built whole and renamed into place,
    after removing those a killed process of this host left with `prefix` (SIGKILL skips the clean-up; an
    export's holds a whole model's weights). A live process's are its own and stay, and so are another
    host's (a shared filesystem: its pid says nothing here)."""
    host = host_tag()
    for left in parent.glob(f"{glob.escape(prefix)}*-*"):
        pid, _, rest = left.name[len(prefix) :].partition("-")
        if pid.isdigit() and rest.startswith(f"{host}-") and not pid_alive(int(pid)) and left.is_dir():
            shutil.rmtree(left, ignore_errors=True)
    return make_output_dir(parent, f"{prefix}{os.getpid()}-{host}-")


def host_tag() -> str:
    """This host in a staging directory's name: its hostname hashed (no '-', the name's separator)."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def follow_umask(root: Path) -> None:
    """Give every file under `root` 0666 and every directory 0777, less the umask: what `open` and `mkdir`
    give. For trees written by libraries that stage files with mkstemp (transformers' `save_pretrained`
    leaves model.safetensors 0600), so a model directory is readable by whoever the umask allows."""
    umask = _umask()
    os.chmod(root, 0o777 & ~umask)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o777 & ~umask)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~umask)


def _umask() -> int:
    umask = os.umask(0)  # the only way to read it; single-threaded CLI callers
    os.umask(umask)
    return umask


def write_resolved_config(run_dir: Path, plain: Mapping[str, Any]) -> Path:
    """`run_dir/config.yaml`: the config as the run resolved it (keys in declaration order)."""
    path = run_dir / RESOLVED_CONFIG
    atomic_write_text(path, yaml.safe_dump(dict(plain), sort_keys=False))
    return path
