"""Where checkpoints live: one step folder per save inside the ``--save`` folder, published whole.

``DIR/step-000200/`` holds one save: DCP's files, ``fasttrain.json`` and the ``.complete``
marker. Every rank writes into ``DIR/.step-000200.tmp/``; once all of them are done, rank 0
writes the JSON record and the marker (each fsynced) and renames the folder into place, an
atomic step. A kill at any moment leaves the earlier step folders as they were plus at most a
temporary folder, which readers never look at. A second save of the same step takes the next
free name (``step-000200.1``) instead of replacing the first, so there is no moment without a
complete one; older folders are removed only after the new one is published.

``DIR/fasttrain.json`` is a copy of the newest record for tools that read a folder's record
(``fasttrain infer --checkpoint``); loading never trusts it: it lists the step folders. A ``DIR``
with ``fasttrain.json`` and DCP's ``.metadata`` at its top is an old-style checkpoint (one save
written in place) and still loads.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable

from ..errors import FasttrainError
from ..measure.files import COMPLETE, write_atomic

META = "fasttrain.json"
DCP_META = ".metadata"  # DCP's file name for its (pickled) Metadata
STEP = re.compile(r"^step-(\d{6,})(?:\.(\d+))?$")
TEMP = re.compile(r"^\.step-\d+\.(tmp|del)$")


def temp_folder(root: Path, step: int) -> Path:
    """The folder every rank writes step ``step``'s save into (the same name on every rank)."""
    return root / f".step-{step:06d}.tmp"


def _fsync_dir(path: Path) -> None:
    """A rename or a new file inside ``path`` survives a power cut once its folder is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin(root: Path, step: int) -> Path:
    """Rank 0, before any rank writes: an empty temporary folder (a cut-off save's is cleared)."""
    temp = temp_folder(root, step)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    return temp


def step_folders(root: Path) -> list[Path]:
    """The published step folders of ``root``, newest (highest step, then latest re-save) first."""
    if not root.is_dir():
        return []
    found = [(int(m[1]), int(m[2] or 0), p) for p in root.iterdir()
             if p.is_dir() and (m := STEP.match(p.name))]
    return [p for *_, p in sorted(found, reverse=True)]


def publish(root: Path, temp: Path, step: int, record: str) -> Path:
    """Rank 0, after every rank's files are written and synced: the record, then the marker,
    then the atomic rename. Returns the published folder."""
    write_atomic(temp / META, record)
    write_atomic(temp / COMPLETE, "")
    _fsync_dir(temp)
    final, n = root / f"step-{step:06d}", 0
    while final.exists():  # a save of this step is already there: keep it until this one is in
        n += 1
        final = root / f"step-{step:06d}.{n}"
    os.rename(temp, final)
    _fsync_dir(root)
    if not (root / DCP_META).exists():  # never over an old-style checkpoint's own record
        write_atomic(root / META, record)
    return final


def prune(root: Path, keep: int) -> None:
    """Rank 0, after a publish: all but the newest ``keep`` step folders go, and what cut-off
    saves left. Each is renamed away first, so a kill while deleting never leaves a
    half-deleted folder under a step folder's name."""
    for old in step_folders(root)[keep:]:
        gone = root / f".{old.name}.del"
        shutil.rmtree(gone, ignore_errors=True)
        os.rename(old, gone)
    for p in root.iterdir():  # no other save of this run is under way now
        if TEMP.match(p.name):
            shutil.rmtree(p, ignore_errors=True)


def _old_style(folder: Path) -> bool:
    return (folder / META).is_file() and (folder / DCP_META).is_file()


def resolve(folder: str | Path, whole: Callable[[Path], bool]) -> Path:
    """The checkpoint ``folder`` names: its newest step folder that ``whole`` accepts, else the
    old-style checkpoint at its top, else ``folder`` itself when it is one save (a step folder
    or an old-style folder given directly). Refused in one line when nothing complete is there."""
    folder = Path(folder)
    steps = step_folders(folder)
    for path in steps:
        if (path / COMPLETE).is_file() and whole(path):
            return path
    if _old_style(folder):
        if STEP.match(folder.name) and not (folder / COMPLETE).is_file():
            raise FasttrainError(f"resume: {folder} is a save that was cut off before it "
                                 "finished: give its --save folder, which holds the last "
                                 "complete one")
        return folder
    cut = steps or ([p for p in folder.iterdir() if p.name.endswith(".tmp") and TEMP.match(p.name)]
                    if folder.is_dir() else [])
    if cut:
        raise FasttrainError(f"resume: no complete checkpoint in {folder}: its {len(cut)} "
                             "save(s) were cut off before they finished; start without "
                             "--resume or save again")
    if (folder / META).is_file():  # a record alone: loading it says what is wrong with it
        return folder
    if not folder.exists():
        raise FasttrainError(f"no fasttrain checkpoint in {folder}: the folder does not exist "
                             "(give the folder that --save wrote)")
    raise FasttrainError(f"no fasttrain checkpoint in {folder}: give the folder that --save "
                         "wrote")
