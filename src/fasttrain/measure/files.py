"""Files that are never seen half-written, and where fasttrain keeps what it makes.

Every file fasttrain writes for a reader (a result row file's new line, a checkpoint's metadata,
a compile cache, a recipe, a synthetic data set) goes through :func:`write_atomic`,
:func:`append_line` or, for a folder of files, :func:`write_folder_atomic`: a crash, a kill or
a full disk leaves the old file or the whole new one, never a part. A full disk (or quota) is
raised as :class:`~fasttrain.errors.DiskFullError`, naming the file and the bytes it needed.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, Union

from ..errors import disk_full

Content = Union[str, bytes, Callable[[Path], None]]
"""Text, bytes, or a function that writes the file at the path it is given (numpy's
``tofile``, ``Image.save``)."""

COMPLETE = ".complete"
"""The marker file of a folder that :func:`write_folder_atomic` finished."""


def write_atomic(path: str | Path, data: Content) -> Path:
    """Write ``data`` to ``path`` through a temporary file beside it, flushed to disk, then a
    rename: readers see the old file or the whole new one. Returns ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    raw = None if callable(data) else data if isinstance(data, bytes) else data.encode()
    with _no_room_is(path, None if raw is None else len(raw)):
        try:
            if callable(data):
                data(tmp)
            else:
                with open(tmp, "wb") as f:
                    f.write(raw)
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # only left when the write failed
    return path


def torch_save(obj, path: str | Path) -> None:
    """``torch.save(obj, path)`` through a Python file, flushed to disk. torch's own file writer
    reports a full disk as ``unexpected pos 704 vs 598``; written through a Python file the same
    failure is an ``OSError`` of ENOSPC, which ``write_atomic`` and the command line name as a
    full disk. For ``write_atomic(path, lambda tmp: torch_save(obj, tmp))``."""
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_folder_atomic(folder: str | Path, fill: Callable[[Path], None]) -> Path:
    """A folder written whole or not at all: ``fill`` writes its files into a temporary folder
    beside it, which is marked complete and renamed into place. A complete folder already there
    is reused as it is (another process won the race, or an earlier run made it). Returns
    ``folder``."""
    folder = Path(folder)
    if (folder / COMPLETE).exists():
        return folder
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with _no_room_is(folder, None):
        tmp.mkdir(parents=True)
        try:
            fill(tmp)
            (tmp / COMPLETE).touch()
            try:
                tmp.rename(folder)
            except OSError:  # another process renamed its complete copy into place first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def append_line(path: str | Path, line: str) -> None:
    """Append one line (a result row), fsynced: a crash later never loses it, and one ``write``
    of one line (``O_APPEND``) keeps lines from parallel writers whole. A write that fails part
    way (a full disk) cuts the file back to its old length: never a torn line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (line.rstrip("\n") + "\n").encode()
    with _no_room_is(path, len(data)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            before = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:  # a short write (the disk filling up) goes on where it stopped
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, before)  # the file as it was: no half line
                raise
        finally:
            os.close(fd)


@contextlib.contextmanager
def _no_room_is(path: Path, needed: int | None) -> Iterator[None]:
    """An ``OSError`` of a full disk or quota inside the block becomes a one-line
    :class:`~fasttrain.errors.DiskFullError` naming ``path`` and the ``needed`` bytes; so does
    a ``RuntimeError`` raised while handling one (torch's file writer, after a failed write)."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        full = disk_full(err, path, needed)
        if full is None:
            raise
        raise full from err


def cache_root() -> Path:
    """Where fasttrain keeps what it makes between runs (synthetic data sets, compile caches):
    ``$FASTTRAIN_CACHE`` or ``~/.cache/fasttrain``."""
    return Path(os.environ.get("FASTTRAIN_CACHE", Path.home() / ".cache" / "fasttrain"))
