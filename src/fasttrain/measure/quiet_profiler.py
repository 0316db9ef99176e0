"""``torch.profiler.profile`` without the profiler library's own start and stop lines.

Some torch builds (the CPU wheels of 2.13 among them) have Kineto print
``USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start`` and a matching
``profiler_stop`` (and at some log levels ``STAGE:`` lines) straight to file descriptor 2 each
time a profile starts and stops; ``KINETO_LOG_LEVEL`` is read once, when torch loads, and some
of its levels print more. fasttrain profiles one probe step of every run, so without this every
``train`` and every ``fasttrain.Step`` would print two such lines although nothing went wrong.

Only the profile's start and stop run with descriptor 2 sent to a temporary file; what the
profiled code itself prints goes out as it happens. Lines other than Kineto's are written back
to stderr afterwards, so nothing else printed in those moments is lost.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

import torch

_KINETO_LINE = re.compile(rb"^(USDT|STAGE):\S+ \S+ \d+:\d+ \w+\.cpp:\d+\] ")


def drop_kineto_lines(text: bytes) -> bytes:
    """``text`` without the lines that Kineto prints for itself."""
    return b"".join(ln for ln in text.splitlines(keepends=True) if not _KINETO_LINE.match(ln))


@contextlib.contextmanager
def _native_stderr_filtered() -> Iterator[None]:
    """Descriptor 2 into a temporary file for the block; then what it caught, less Kineto's
    own lines, to stderr. Where descriptor 2 cannot be duplicated, nothing is redirected."""
    try:
        caught = tempfile.TemporaryFile()
    except OSError:  # no temporary folder to write to: the lines go out as they are
        yield
        return
    try:
        saved = os.dup(2)
    except OSError:
        caught.close()
        yield
        return
    with caught:
        sys.stderr.flush()
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            rest = drop_kineto_lines(caught.read())
            if rest:
                sys.stderr.write(rest.decode(errors="replace"))
                sys.stderr.flush()


@contextlib.contextmanager
def quiet_profile(**kwargs) -> Iterator[torch.profiler.profile]:
    """``with torch.profiler.profile(**kwargs) as prof``, Kineto's start and stop lines left out."""
    prof = torch.profiler.profile(**kwargs)
    with _native_stderr_filtered():
        prof.__enter__()
    try:
        yield prof
    finally:  # the profile stops either way (its __exit__ never swallows an error)
        with _native_stderr_filtered():
            prof.__exit__(None, None, None)
