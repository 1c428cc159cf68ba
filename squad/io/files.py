"""Writing files so that nothing half-written is ever left, and a failed write says what, where and how much room
there is.

Every file a tool writes goes through `atomic_path` (or the helpers built on it: `atomic_write_bytes`,
`atomic_write_text`, `atomic_torch_save`): the bytes go to a temporary file beside the target, which is flushed to
disk (``fsync``) and renamed over the target (``os.replace``), so the target is either the old file or the whole new
one. When the write fails — a full disk (ENOSPC), a quota, an I/O error, a folder that became read-only — the
temporary file is removed (a partial file never keeps the disk full) and `WriteError` is raised with `write_failure`'s
message: what was written, the path, the reason and the space left on that filesystem. The tools exit 3 on it
(`squad.cli.run`), as training does when a checkpoint cannot be saved. `check_writable` is the up-front check a tool
makes before its heavy work, so that a folder that cannot be written is refused at once (a `PermissionError`: exit 2).

Serialisers that write through C++ (``torch.save``, ``torch.export.save``) write into memory first: torch's zip writer
aborts the process (SIGABRT) or leaves a corrupt file when the disk fills under it, while a Python write raises a
clean ``OSError``. A target that exists and is not a regular file (``/dev/full``, a FIFO, ``/dev/stdout``) is written
in place, never renamed over.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import io
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

# errno values that mean the user pointed the tool at a place it may not write (bad input, exit 2), as opposed to a
# write that failed on the way (a full disk, an I/O error: exit 3)
PERMISSION_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


class WriteError(OSError):
    """A file could not be written; the message (`write_failure`) names it, the reason and the free space.

    An ``OSError`` (``errno`` is the underlying error's when there was one: ``errno.ENOSPC`` for a full disk), so
    code that handles failed writes as ``OSError`` handles it too; the tools exit 3 on it (`squad.cli.run`).

    Attributes:
        path: the file (or folder) being written.
    """

    def __init__(self, message: str, path: str | Path, errno_: int | None = None):
        super().__init__(message)
        self.path = Path(path)
        self.errno = errno_

    def __reduce__(self):  # raised in a worker process, re-raised in the tool's (ProcessPoolExecutor pickles it)
        return (type(self), (str(self), str(self.path), self.errno))


def free_space(path: str | Path) -> int | None:
    """Bytes free on the filesystem holding ``path`` (its nearest existing ancestor), or None if unknown."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def write_failure(what: str, path: str | Path, error: BaseException) -> str:
    """A message for a failed write: what was being written, where, the error, and the space left there.

    Args:
        what: e.g. ``"checkpoint step00000060"``.
        path: the file or folder written.
        error: what the write raised (torch reports a full disk as ``basic_ios::clear: iostream error``).
    """
    path = Path(path)
    code = _errno(error)
    reason = os.strerror(code) if code else f"{type(error).__name__}: {str(error)[:200]}"
    if code in PERMISSION_ERRNOS:  # a read-only filesystem or a folder without permission: space is not the cause
        return f"could not write {what} to {path}: {reason}"
    free = free_space(path)
    space = ""
    if free is not None:
        space = f"; {free / 2**20:.1f} MiB free on that filesystem"
        if code in (errno.ENOSPC, errno.EDQUOT) or free < 64 * 2**20:
            space += " (the disk is full or nearly: free some space)"
    return f"could not write {what} to {path}: {reason}{space}"


def _errno(error: BaseException) -> int | None:
    """The OS error number of a failed write: an ``OSError``'s, or the one HDF5 quotes in its own errors."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    found = re.search(r"\berrno = (\d+)", str(error))
    return int(found.group(1)) if found else None


# how torch's C++ zip writer reports a write that failed under it (a full disk): no errno reaches Python
_TORCH_WRITE_FAILURES = ("unexpected pos", "file write failed", "basic_ios::clear")


def failed_write(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is a write that failed on the way — a full disk, a quota, an I/O
    error — rather than bad input: an ``OSError`` with such an errno, or torch's writer's own words for one."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG):
            return True
        if any(text in str(e) for text in _TORCH_WRITE_FAILURES):
            return True
        e = e.__cause__ or e.__context__
    return False


def fail(what: str, path: str | Path, error: BaseException) -> WriteError:
    """The `WriteError` for ``error`` raised while writing ``what`` to ``path``."""
    return WriteError(write_failure(what, path, error), path, _errno(error))


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_special(path: Path) -> bool:
    """Whether ``path`` exists and is not a regular file (a device such as /dev/full, a FIFO): written in place."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def temporary_name(path: Path) -> Path:
    """The temporary file `atomic_path` writes before the rename: hidden, beside ``path``, with its suffix (some
    writers choose the format by it: ``.png``, ``.npy``, ``.pt2``)."""
    return path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")


@contextlib.contextmanager
def atomic_path(path: str | Path, what: str | None = None, *, sync: bool = True) -> Iterator[Path]:
    """Yields a temporary path to write; on success it replaces ``path`` (fsync, rename, fsync of the folder).

    On any exception the temporary file is removed; an ``OSError`` or a ``RuntimeError`` (how torch and h5py report
    a failed write) becomes a `WriteError` naming ``path`` and the free space, anything else propagates unchanged.
    The folder of ``path`` is created; a folder that cannot be (a path through a file, no permission) is bad input:
    ``NotADirectoryError`` / ``PermissionError`` (exit 2).

    Args:
        path: the file to write.
        what: what the file is, for the message (default: ``path``'s name).
        sync: fsync the file and its folder (False for the many small files of a dataset render, which syncs the
            filesystem once before it writes its manifest: `sync_tree`).
    """
    path = Path(path)
    what = what or path.name
    special = _is_special(path)
    try:
        if special:
            scratch = Path(tempfile.mkdtemp(prefix=".squad-write-"))
            tmp = scratch / f"out{path.suffix}"
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            scratch, tmp = None, temporary_name(path)
    except (FileExistsError, NotADirectoryError) as e:  # a path through a file: bad input (exit 2)
        raise NotADirectoryError(f"cannot write {what} to {path}: a part of that path is a file, not a folder") from e
    except OSError as e:
        if e.errno in PERMISSION_ERRNOS:
            raise PermissionError(f"cannot write {what} to {path}: {os.strerror(e.errno)}") from e
        raise fail(what, path, e) from e
    try:
        yield tmp
        if special:  # a device or FIFO: copy the bytes in (no rename over a device node)
            with open(tmp, "rb") as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
            return
        if sync:
            _fsync(tmp)
        os.replace(tmp, path)
        if sync:
            with contextlib.suppress(OSError):  # not every filesystem syncs folders
                _fsync(path.parent, directory=True)
    except (OSError, RuntimeError) as e:
        raise fail(what, path, e) from e
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def write_all(file: Any, data: bytes | memoryview) -> None:
    """Writes ``data`` to an open binary file (the one place the tools' bytes reach the disk; a failing disk raises
    here: ``OSError``)."""
    view = memoryview(data)
    while len(view):
        n = file.write(view[: 1 << 24])
        view = view[n if n is not None else len(view):]


def atomic_write_bytes(path: str | Path, data: bytes | memoryview, what: str | None = None, *,
                       sync: bool = True) -> Path:
    """Writes ``data`` to ``path`` atomically (`atomic_path`).

    Raises:
        WriteError: the write failed (nothing is left at ``path`` but what was there before).
    """
    path = Path(path)
    with atomic_path(path, what, sync=sync) as tmp, open(tmp, "wb") as f:
        write_all(f, data)
    return path


def atomic_write_text(path: str | Path, text: str, what: str | None = None, *, sync: bool = True) -> Path:
    """Writes ``text`` (UTF-8) to ``path`` atomically (`atomic_path`).

    Raises:
        WriteError: the write failed.
    """
    return atomic_write_bytes(path, text.encode("utf-8"), what, sync=sync)


def atomic_save(path: str | Path, write: Callable[[IO[bytes]], Any], what: str | None = None, *,
                sync: bool = True) -> Path:
    """Writes what ``write(file)`` writes into a binary file object, atomically: serialised in memory first, then
    `atomic_write_bytes` (e.g. ``lambda f: np.save(f, a)``, ``lambda f: image.save(f, format="PNG")``).

    Raises:
        WriteError: the write failed.
    """
    buf = io.BytesIO()
    write(buf)
    return atomic_write_bytes(path, buf.getbuffer(), what, sync=sync)


def atomic_torch_save(obj: Any, path: str | Path, what: str | None = None) -> Path:
    """``torch.save(obj, path)``, atomically: serialised in memory, then written by `atomic_write_bytes` (torch's
    own writer can abort the process on a full disk).

    Raises:
        WriteError: the write failed.
    """
    import torch  # only here: the text writes load without it

    return atomic_save(path, lambda f: torch.save(obj, f), what)


@contextlib.contextmanager
def removed_on_failure(paths: Sequence[str | Path], what: str) -> Iterator[None]:
    """Removes ``paths`` (files or folders this job created) when a `WriteError` leaves the block, and re-raises it
    saying so: a job that writes many files (a dataset render) leaves nothing half-done to fill the disk.

    Args:
        paths: what the job creates; only these are removed.
        what: the job's output, for the message (``"the render in data/x"``).
    """
    try:
        yield
    except WriteError as e:
        for p in map(Path, paths):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink(missing_ok=True)
        raise WriteError(f"{e}; {what} was incomplete and is removed: make room and run the same command again",
                         e.path, e.errno) from e


def sync_tree(path: str | Path) -> None:
    """Flushes everything written under ``path`` to disk: ``syncfs`` of its filesystem (Linux; only that
    filesystem), else ``sync``."""
    try:
        fd = os.open(Path(path), os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        os.sync()
        return
    try:
        if _syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def _syncfs(fd: int) -> int:
    """libc's ``syncfs(fd)`` (Python has no binding): 0 on success, -1 where it is missing or fails."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.syncfs(fd))
    except (OSError, AttributeError):
        return -1


def check_writable(path: str | Path, what: str, *, folder: bool = False) -> Path:
    """Refuses, before any work, an output the tool could not write (nothing is created: the nearest folder that
    exists is probed with a temporary file, removed at once).

    Args:
        path: the output file (or, with ``folder=True``, the output folder).
        what: the argument that named it (``"--out"``), for the message.
        folder: ``path`` is a folder to write files into.

    Returns:
        ``path``.

    Raises:
        PermissionError: nothing can be written there (exit 2); the message names the path.
        IsADirectoryError / NotADirectoryError: a folder where a file is expected, or a file where a folder is.
        WriteError: the probe failed for another reason (a full disk).
    """
    path = Path(path)
    if not folder and path.is_dir():
        raise IsADirectoryError(f"{what} {path} is a folder; give a file name")
    if not folder and _is_special(path):
        return path  # a device or FIFO: written in place
    if folder and path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{what} {path} is a file, not a folder")
    target = path if folder else path.parent
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(f"{what} {path}: {existing} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".squad-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        if e.errno in PERMISSION_ERRNOS:
            raise PermissionError(f"{what} {path}: cannot write into {existing} ({os.strerror(e.errno)})") from e
        raise fail(what, existing, e) from e
    return path
