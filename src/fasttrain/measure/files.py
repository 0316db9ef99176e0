"""Files that are never seen half-written, and where fasttrain keeps what it makes.

Every file fasttrain writes for a reader (a result row file's new line, a checkpoint's metadata,
a compile cache, a recipe, a synthetic data set) goes through :func:`write_atomic`,
:func:`append_line` or, for a folder of files, :func:`write_folder_atomic`: a crash, a kill or
a full disk leaves the old file or the whole new one, never a part.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Union

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
    try:
        if callable(data):
            data(tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(data if isinstance(data, bytes) else data.encode())
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left when the write failed
    return path


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
    """Append one line (a result row), flushed and fsynced: a crash later never loses it, and
    one ``write`` of one line keeps lines from parallel writers whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(line.rstrip("\n") + "\n")
        f.flush()
        os.fsync(f.fileno())


def cache_root() -> Path:
    """Where fasttrain keeps what it makes between runs (synthetic data sets, compile caches):
    ``$FASTTRAIN_CACHE`` or ``~/.cache/fasttrain``."""
    return Path(os.environ.get("FASTTRAIN_CACHE", Path.home() / ".cache" / "fasttrain"))
