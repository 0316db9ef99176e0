"""Presets shipped with fasttrain: for each reference and public workload, the best recipe
measured against PyTorch best practice, with where it was measured.

Each ``NAME.toml`` here holds a ``[preset]`` table (workload, size, GPU, the measured ratio to
the peer and the rows it comes from) and the ``[recipe]`` a run loads. ``--preset NAME`` runs one
(on the workload it was measured on); ``--preset fast`` picks the workload's best measured
preset for the size and GPU class in use; ``fasttrain presets`` lists them.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..errors import FasttrainError

HOPPER = ("H100", "H200")  # the GPU class the presets were measured on


@dataclass(frozen=True)
class Preset:
    name: str
    workload: str
    size: str
    gpu: str
    ratio: float | None  # against the peer, confirmed steady; None: not confirmed
    rows: str  # the result rows it was measured in (benchmarks/results/ of the repository)
    source: str  # its file under benchmarks/results/presets/
    what: str
    path: Path


def presets() -> dict[str, Preset]:
    """Every shipped preset by name."""
    out = {}
    for path in sorted(Path(__file__).parent.glob("*.toml")):
        meta = tomllib.loads(path.read_text())["preset"]
        out[path.stem] = Preset(path.stem, meta["workload"], meta["size"], meta["gpu"],
                                meta.get("ratio"), meta["rows"], meta["source"], meta["what"],
                                path)
    return out


def gpu_class(device_name: str) -> str | None:
    """``Hopper`` for an H100 or H200 (the class the presets were measured on), else None."""
    return "Hopper" if any(g in device_name for g in HOPPER) else None


def resolve(name: str, workload: str, size: str, device_name: str | None) -> Preset:
    """The preset ``--preset NAME`` means for this run; ``fast``: the best measured one for the
    workload and size on this GPU class. ``device_name``: the GPU's name, None on a CPU."""
    known = presets()
    if name != "fast":
        if name not in known:
            raise FasttrainError(f"no preset {name!r}: use one of {', '.join(known)} or fast "
                                 "(fasttrain presets lists them)")
        preset = known[name]
        if preset.workload != workload:
            raise FasttrainError(f"preset {name} was measured on {preset.workload}, not "
                                 f"{workload}: run it there, or give its file to --recipe")
        return preset
    if device_name is None or gpu_class(device_name) is None:
        where = device_name or "a CPU"
        raise FasttrainError(f"--preset fast: the presets were measured on H100/H200 GPUs, not "
                             f"on {where}; search one here with --rungs fast")
    mine = [p for p in known.values() if p.workload == workload and p.size == size
            and p.ratio is not None]
    if not mine:
        raise FasttrainError(f"--preset fast: no measured preset for {workload} {size}; search "
                             f"one with fasttrain ladder {workload} --size {size} --rungs fast")
    return max(mine, key=lambda p: p.ratio)


__all__ = ["Preset", "gpu_class", "presets", "resolve"]
