"""Scratch folders: where a command keeps its children's files (a rung's spec, row and log).

A scratch folder is removed when its command ends, also on Ctrl-C or SIGTERM. A command killed
outright (SIGKILL, a lost machine) cannot clean up, so each folder's name carries its process
id, and every new scratch folder first removes the ones whose process is gone.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

_NAME = re.compile(r"^fasttrain-[a-z]+-(\d+)-")


@contextlib.contextmanager
def scratch(kind: str, root: str | Path | None = None) -> Iterator[Path]:
    """A fresh folder ``fasttrain-KIND-PID-…`` under ``root`` (the system's temporary folder),
    removed when the block ends; left-overs of dead commands are removed first."""
    sweep(root)
    with tempfile.TemporaryDirectory(prefix=f"fasttrain-{kind}-{os.getpid()}-",
                                     dir=root) as tmp:
        yield Path(tmp)


def sweep(root: str | Path | None = None) -> list[Path]:
    """Remove the scratch folders whose command is no longer running; the ones removed."""
    base = Path(root or tempfile.gettempdir())
    gone = []
    for folder in base.glob("fasttrain-*-*-*"):
        m = _NAME.match(folder.name)
        if m and folder.is_dir() and not _alive(int(m.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
