"""Writing files so that nothing half-written is ever left: `atomic_write_text` and `atomic_torch_save` (a temporary
file, then ``os.replace``), and `write_failure`, the message every tool gives when a write fails (what, where, why,
and the space left on that filesystem).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch


def atomic_write_text(path: str | Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and ``os.replace`` (never a half-written file; the
    temporary file is removed when the write fails, e.g. on a full disk)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)`` through a temporary file and ``os.replace`` (never a half-written file; the
    temporary file is removed when the write fails, e.g. on a full disk)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_failure(what: str, path: str | Path, error: BaseException) -> str:
    """A message for a failed write: what was being written, where, the error, and the space left there.

    Args:
        what: e.g. ``"checkpoint step00000060"``.
        path: the file or folder written.
        error: what the write raised (torch reports a full disk as ``basic_ios::clear: iostream error``).
    """
    path = Path(path)
    if isinstance(error, OSError) and error.errno:
        reason = os.strerror(error.errno)
    else:
        reason = f"{type(error).__name__}: {str(error)[:200]}"
    where = path if path.exists() else path.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
        space = f"; {free / 2**20:.1f} MiB free on that filesystem"
        if free < 64 * 2**20 or (isinstance(error, OSError) and error.errno == errno.ENOSPC):
            space += " (the disk is full or nearly: free some space)"
    except OSError:
        space = ""
    return f"could not write {what} to {path}: {reason}{space}"
