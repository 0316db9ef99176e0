"""User-facing errors: one line naming the problem, never a traceback."""
from __future__ import annotations

import errno
import os
import shutil


class FasttrainError(Exception):
    """A mistake in what the user asked for (bad recipe, unknown workload, impossible combo).

    The CLI prints ``str(err)`` on one line and exits with status 2.
    """


class RunFailed(FasttrainError):
    """A run that could not go on for a reason outside the command (a rank that hung): the CLI
    prints ``str(err)`` on one line and exits with status 1, as for any failed run."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""The errnos of a write that found no room: the disk is full, or the user's quota is."""


class DiskFullError(RunFailed):
    """A write that found the disk (or the quota) full: the CLI prints one line naming the file
    and the space it needed, and exits with status 1. ``needed``: the bytes being written, None
    where unknown (the line then says how much is free there)."""

    def __init__(self, path: str | os.PathLike, needed: int | None = None, quota: bool = False):
        self.path, self.needed, self.quota = str(path), needed, quota
        full = "the disk quota is exceeded" if quota else "the disk is full"
        if needed is not None:
            room = f"{_size(needed)} needed"
        else:
            free = _free(self.path)
            room = "space needed unknown" if free is None else f"{_size(free)} free there"
        super().__init__(f"{full}: cannot write {self.path} ({room}): free space or pass --out "
                         "elsewhere")

    def __reduce__(self):  # across processes, rebuilt from what it carries
        return type(self), (self.path, self.needed, self.quota)


def disk_full(err: BaseException, path: str | os.PathLike | None = None,
              needed: int | None = None) -> DiskFullError | None:
    """``err`` as a :class:`DiskFullError` when it, or an exception it came from, is one or is
    an ``OSError`` of ENOSPC/EDQUOT (``path`` where the error names no file); else None."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiskFullError):
            return e
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return DiskFullError(path or e.filename or "a file", needed, e.errno == errno.EDQUOT)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return None


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _free(path: str) -> int | None:
    """Free bytes on the filesystem of ``path`` (its nearest folder that exists)."""
    p = os.path.abspath(path)
    while p and not os.path.exists(p):
        p = os.path.dirname(p) if os.path.dirname(p) != p else ""
    try:
        return shutil.disk_usage(p or ".").free
    except OSError:
        return None


def missing_dependency(package: str, err: ModuleNotFoundError) -> str | None:
    """The top-level module that ``package`` failed to import because it is not installed,
    where that is not ``package`` itself (timm installed, torchvision not); else None."""
    dep = (err.name or "").split(".")[0]
    return dep if dep and dep != package.split(".")[0] else None


def first_line(err: BaseException, width: int = 160) -> str:
    """The first line of ``err``'s message, at most ``width`` characters (its type's name when
    the message is empty): what a one-line refusal quotes of the error behind it."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:width]


def describe_error(err: BaseException, width: int = 300) -> str:
    """``Type: first line`` of an exception, plus the first exception of its chain when that is a
    different one: a CUDA graph capture reports "operation failed due to a previous error during
    capture", while the cause is the exception raised inside the capture."""
    def line(e: BaseException) -> str:
        text = str(e).splitlines()[0][:width] if str(e) else ""
        return f"{type(e).__name__}: {text}" if text else type(e).__name__

    def before(e: BaseException) -> BaseException | None:
        return e.__cause__ or (None if e.__suppress_context__ else e.__context__)

    root, seen = err, {id(err)}
    while (nxt := before(root)) is not None and id(nxt) not in seen:
        root = nxt
        seen.add(id(nxt))
    return line(err) if root is err else f"{line(err)} (first: {line(root)})"
