"""Files that are never seen half-written, and where fasttrain keeps what it makes.

Every file fasttrain writes for a reader (a result row file's new line, a checkpoint's metadata,
a compile cache, a recipe, a synthetic data set) goes through :func:`write_atomic` or
:func:`append_line`: a crash, a kill or a full disk leaves the old file or the whole new one,
never a part.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Union

Content = Union[str, bytes, Callable[[Path], None]]
"""Text, bytes, or a function that writes the file at the path it is given (numpy's
``tofile``, ``Image.save``)."""


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
