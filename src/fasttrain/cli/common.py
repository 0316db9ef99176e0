"""What every command shares: --opt values, --out files (made unique, dropped when left
empty), --device, the base recipe (--recipe, --preset, --set, --batch), the checks argparse
cannot make, and the one line of an error."""
from __future__ import annotations

import ast
import datetime
import os
import re
import sys
from pathlib import Path

from ..errors import FasttrainError


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _options(items: list[str] | None) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise FasttrainError(f"--opt expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = _literal(v.strip())
    return out


def _out_folder(folder: str) -> None:
    """--out must be a folder this user can write (created if missing)."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise FasttrainError(f"--out {folder} is a file, not a folder: give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise FasttrainError(f"--out {folder}: cannot create the folder ({err.strerror}): "
                             "give a folder you can write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise FasttrainError(f"--out {folder} is not writable: give a folder you can write")


def _out_path(args, kind: str, size: str, suffix: str = ".jsonl") -> Path:
    """``out/<kind>-<workload>-<size>-<time><suffix>`` (a module:factory made file-safe), made
    here (a folder where ``suffix`` is empty) so that no other command gets it: a second one
    started in the same second with the same --out gets ``-2``, ``-3``… before the suffix.
    Left empty, it is removed when the command ends (:func:`_drop_unused_outputs`)."""
    _out_folder(args.out)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = re.sub(r"[^A-Za-z0-9_-]", "_", args.workload)
    for n in range(1, 10_000):
        path = Path(args.out) / f"{kind}-{name}-{size}-{stamp}{f'-{n}' if n > 1 else ''}{suffix}"
        if os.environ.get("RANK", "0") != "0":  # a torchrun rank other than 0 writes no rows
            return path
        try:
            if suffix:
                open(path, "x").close()
            else:
                path.mkdir()
        except FileExistsError:
            continue
        _OUTPUTS.append(path)
        return path
    raise FasttrainError(f"--out {args.out}: 10,000 {kind} files of this second already: give "
                         "another folder")


_OUTPUTS: list[Path] = []
"""The files and folders :func:`_out_path` made for the command under way."""


def _drop_unused_outputs() -> None:
    """Remove what :func:`_out_path` made and nothing filled (a run refused or stopped before
    its first row)."""
    while _OUTPUTS:
        path = _OUTPUTS.pop()
        try:
            if path.is_dir():
                path.rmdir()  # only an empty one
            elif path.stat().st_size == 0:
                path.unlink()
        except OSError:  # a folder with files, or gone already
            pass


def _file_target(path: str, flag: str) -> None:
    """A file a command writes after its run (``--export``, ``--suggest-recipe``) is checked
    before it: not a folder, in a folder that exists and this user can write."""
    p = Path(path)
    if p.is_dir():
        raise FasttrainError(f"{flag} {path} is a folder: give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise FasttrainError(f"{flag} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FasttrainError(f"{flag} {path}: the folder {parent} is not writable")


def _device(arg: str) -> str:
    """--device as the library resolves it: auto → cuda or cpu; an unknown device, or CUDA
    where there is none, is a one-line error."""
    from ..run.loop import resolve_device

    dev = resolve_device(arg)
    return str(dev) if arg == "auto" else arg


def _check_common(args) -> None:
    """Values argparse accepts but no run can use: refused before anything starts."""
    if args.steps < 1 or args.warmup < 0:
        raise FasttrainError("--steps must be >= 1 and --warmup >= 0")
    if args.nproc < 1 or args.nnodes < 1:
        raise FasttrainError("--nproc and --nnodes must be >= 1")
    if args.batch is not None and args.batch < 1:
        raise FasttrainError("--batch must be >= 1 (leave it out for the workload's default)")
    if getattr(args, "rung_timeout", None) is not None and args.rung_timeout <= 0:
        raise FasttrainError("--rung-timeout must be > 0 seconds (leave it out for no limit)")


def _use_preset(args) -> None:
    """--preset NAME (or fast) becomes the shipped file as --recipe."""
    if not getattr(args, "preset", None):
        return
    if args.recipe:
        raise FasttrainError("give --preset or --recipe, not both")
    import torch

    from ..presets import resolve

    device = _device(args.device)
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None
    size = args.size or ("base" if device.startswith("cuda") else "tiny")
    args.recipe = str(resolve(args.preset, args.workload, size, name).path)


def _base_recipe(args):
    from ..recipe import Recipe, load_toml, parse_sets

    base = load_toml(args.recipe) if args.recipe else Recipe()
    sets = parse_sets(args.set)
    if args.batch is not None:
        sets["batch"] = str(args.batch)
    return base.replace(**sets) if sets else base


def _error(message: object, code: int) -> int:
    """The one line of an error on stderr (a message's own line breaks folded); ``code``."""
    text = " ".join(str(message).split("\n")).strip()
    print(f"fasttrain: error: {text}", file=sys.stderr)
    return code
