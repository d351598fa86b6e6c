"""Files on disk that are whole or absent, and one error for every write that fails.

Every file litft writes for later reading goes through write_atomic (a temporary file beside it, fsync, rename); a
folder goes through write_dir_atomic (a temporary folder beside it, moved into place whole). Every write litft makes
runs through this module (``writing`` and the functions built on it): an OSError becomes one WriteError (exit 6)
naming what was being written, the path, the OS reason in words, and what to try.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from litft import units
from litft.errors import CheckpointError


class WriteError(CheckpointError, OSError):
    """A file or folder litft writes could not be written: exit 6, as every CheckpointError. It is an OSError too,
    so a caller that can do without a write (a cache) catches it as one."""

    kind = "I/O error"


def write_error(err: OSError, what: str, path: Path, setting: str = "out_dir", note: str = "") -> WriteError:
    """The one message for a failed write: ``what`` was being written, to ``path``, the OS reason, what to try
    (``setting`` names the option that chose the folder: out_dir, --out, --plot), then ``note``."""
    if isinstance(err, WriteError):  # already said, by a write nested in this one
        return err
    reason = os.strerror(err.errno) if err.errno else (err.strerror or str(err))
    if err.errno == errno.ENOSPC:
        with contextlib.suppress(OSError):
            reason += f" ({units.size(free_bytes(path))} free)"
    message = f"cannot write {what} '{path}': {reason}. {_what_to_try(err.errno, path, setting)}"
    if note:
        message += f". {note}"
    earlier = err.__context__
    if isinstance(earlier, WriteError):
        # this write ran while an earlier failed write was being handled (a failed run's result.json after its final
        # weights, on a full disk): the earlier failure is the cause, reported first
        return WriteError(f"{earlier}. Then {what} '{path}' could not be written either: {reason}")
    return WriteError(message)


def _what_to_try(code: int | None, path: Path, setting: str) -> str:
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"Free space on that disk, or set {setting} to a folder on another disk"
    if code == errno.EROFS:
        return f"Set {setting} to a folder on a writable disk"
    if code in (errno.EACCES, errno.EPERM):
        return f"Set {setting} to a folder you can write to, or get write permission there"
    if code in (errno.ENOTDIR, errno.EEXIST):
        blocker = file_in_the_way(path)
        if blocker is not None:
            which = "It" if blocker == Path(path).absolute() else f"'{blocker}'"
            return f"{which} is a file where a folder belongs: move it away, or set {setting} to another folder"
    if code == errno.EISDIR:
        return f"'{path}' is a folder where a file belongs: move it away, or set {setting} to another folder"
    if code == errno.ENAMETOOLONG:
        return f"Set {setting} to a shorter path"
    return f"Check '{path}' and its disk, or set {setting} to another folder"


@contextlib.contextmanager
def writing(what: str, path: Path, setting: str = "out_dir", note: str = "") -> Iterator[None]:
    """Run a write: an OSError inside it is raised as write_error's WriteError (exit 6)."""
    try:
        yield
    except OSError as err:
        raise write_error(err, what, path, setting, note) from None


def existing_ancestor(path: Path) -> Path:
    """``path`` if it exists, else the nearest existing path above it (a file, where the path lies under one)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def file_in_the_way(path: Path) -> Path | None:
    """The file at ``path`` or above it that keeps it from being a folder, if there is one."""
    found = existing_ancestor(path)
    return None if found.is_dir() else found


def free_bytes(path: Path) -> int:
    """Free space on the disk that holds ``path`` (or would hold it, once created)."""
    return shutil.disk_usage(existing_ancestor(path)).free


def check_free_space(directory: Path, needed_bytes: int, what: str, hint: str | None = None,
                     setting: str = "out_dir") -> None:
    """Raise WriteError (exit 6) before a large write when the disk that holds ``directory`` has less than
    ``needed_bytes`` free. ``hint`` says what to try (by default: free space, or another disk for ``setting``)."""
    free = free_bytes(directory)
    if needed_bytes > free:
        hint = hint or _what_to_try(errno.ENOSPC, directory, setting)
        raise WriteError(f"not enough disk space for {what} in '{directory}': it needs about"
                         f" {units.size(needed_bytes)}, {units.size(free)} are free. {hint}")


def check_writable(directory: Path, setting: str = "out_dir") -> None:
    """Raise WriteError (exit 6) unless files can be written into ``directory``: it is a folder, or can be created
    (no file at or above it), and the nearest existing folder takes new entries (tried with a probe folder, made and
    removed there: permissions alone do not tell a read-only disk or a root user's limits). Leaves nothing behind."""
    directory = Path(directory)
    blocker = file_in_the_way(directory)
    if blocker is not None:
        code = errno.EEXIST if blocker == directory.absolute() else errno.ENOTDIR
        raise write_error(OSError(code, os.strerror(code)), f"into {setting}", directory, setting)
    with writing(f"into {setting}", directory, setting):
        os.rmdir(tempfile.mkdtemp(prefix=".litft-write-check-", dir=existing_ancestor(directory)))


def make_dir(path: Path, what: str, setting: str = "out_dir") -> None:
    """Create the folder ``path`` and its parents, if missing."""
    with writing(what, path, setting):
        path.mkdir(parents=True, exist_ok=True)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (the directory entry itself is data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: Path) -> None:
    """Remove a temporary file or folder after a failure; the failure is what gets reported."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def write_atomic(path: Path, write: Callable[[Path], None], durable: bool = True, what: str | None = None,
                 setting: str = "out_dir") -> None:
    """Call ``write(tmp)`` for a temporary file beside ``path``, fsync it (``durable``), then rename it over
    ``path``: a reader sees the old file or the new one, never a part. A failed write removes the temporary file and
    raises WriteError, naming ``what`` (default: the file's name). The temporary name carries the process id, so
    ranks or runs writing the same path do not collide."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with writing(what or path.name, path, setting):
            write(tmp)
            if durable:
                fsync_file(tmp)
            os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise


def write_dir_atomic(path: Path, write: Callable[[Path], None], what: str, tmp: Path | None = None,
                     note: str = "") -> None:
    """Call ``write(tmp)`` for a new temporary folder beside ``path`` (``tmp``, or a name of this process), fsync
    every file in it, then move it into ``path``'s place whole, replacing the folder there. A failed write removes
    the temporary folder and raises WriteError naming ``what``, with ``note``."""
    tmp = tmp or path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with writing(what, path, note=note):
            tmp.mkdir()
            write(tmp)
            move_dir_into_place(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise


def move_dir_into_place(tmp: Path, path: Path) -> None:
    """Fsync every file of the finished folder ``tmp``, then put it in ``path``'s place whole (replacing the folder
    there) and fsync the parent: a reader sees the old folder or the new one."""
    for file in tmp.rglob("*"):
        if file.is_file():
            fsync_file(file)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str, durable: bool = True, what: str | None = None,
                      setting: str = "out_dir") -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), durable, what, setting)


def write_json_atomic(path: Path, value: Any, durable: bool = True, what: str | None = None) -> None:
    write_text_atomic(path, json.dumps(value, indent=2, default=str), durable, what)


def torch_save(state: Any, path: Path) -> None:
    """torch.save through a Python file: a full disk raises OSError (ENOSPC), where torch's own writer raises a
    RuntimeError without the reason."""
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)


def torch_save_atomic(state: Any, path: Path, what: str | None = None) -> None:
    write_atomic(path, lambda tmp: torch_save(state, tmp), what=what)
