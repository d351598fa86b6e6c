"""Files on disk that are whole or absent: every file litft writes for later reading goes through write_atomic."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


def write_atomic(path: Path, write: Callable[[Path], None], durable: bool = True) -> None:
    """Call ``write(tmp)`` for a temporary file beside ``path``, fsync it (``durable``), then rename it over
    ``path``: a reader sees the old file or the new one, never a part. A failed write removes the temporary file.
    The temporary name carries the process id, so ranks or runs writing the same path do not collide."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        if durable:
            fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str, durable: bool = True) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), durable)


def write_json_atomic(path: Path, value: Any, durable: bool = True) -> None:
    write_text_atomic(path, json.dumps(value, indent=2, default=str), durable)


def torch_save_atomic(state: Any, path: Path) -> None:
    import torch

    write_atomic(path, lambda tmp: torch.save(state, tmp))
