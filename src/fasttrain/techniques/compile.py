"""torch.compile: the whole model, or each repeated block ("regional").

When it helps: fuses elementwise work around the GEMMs and cuts launches ("a few percent and
more"). Regional compile traces one block and reuses it for every identical block, so warm-up
drops from minutes to seconds for deep models (SD's UNet) at a small cost in fusion across block
boundaries. Numerics: fp32-equivalent (fusion reorders rounding). Requirements: a C++ compiler on
CPU, Triton on CUDA, for the inductor backend.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import torch

from .base import Phase, Technique, TrainState


def _recompile_limit_attr() -> str:
    cfg = torch._dynamo.config
    return "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"


def apply(state: TrainState) -> str | None:
    r = state.recipe
    state.compile_baseline = graph_stats()  # dynamo's counters are per process, not per run
    # Static shapes: every block always sees the same shapes. Regional compile runs every block
    # through the one Module._call_impl code object, so without this the second distinct block
    # shape turns on dynamo's automatic dynamic shapes and later blocks get dynamic-shape graphs.
    opts = {"mode": None if r.compile_mode == "default" else r.compile_mode,
            "backend": r.compile_backend, "dynamic": False}
    tuned = _inductor_switches(state) + _load_cache(state)
    if r.compile == "model":
        state.model.compile(**opts)
        return f"whole model compiled (backend {r.compile_backend}, mode {r.compile_mode}){tuned}"
    blocks = state.workload.regional_blocks(state.model)
    if not blocks:
        state.warn("compile", "regional: no repeated blocks found; compiled the whole model")
        state.model.compile(**opts)
        return "whole model compiled (no repeated blocks)"
    # Every compiled block runs the same Module._call_impl code object, so each distinct block
    # shape is one cache entry of it: lift the limit above the number of distinct blocks, or
    # dynamo gives up after 8 and silently runs the rest eagerly.
    kinds = Counter(type(b).__name__ for b in blocks)
    attr = _recompile_limit_attr()
    need = max(getattr(torch._dynamo.config, attr), 4 * len(blocks))
    state.set_flag(torch._dynamo.config, attr, need)
    for block in blocks:
        block.compile(**opts)
    listing = ", ".join(f"{n}x {k}" for k, n in kinds.most_common(4))
    return (f"regional: {len(blocks)} blocks compiled ({listing}); rest eager; "
            f"{attr}={need}{tuned}")


# Inductor options that recipe switches turn on for their run: (switch, the config object's
# path under torch._inductor.config, its flag, what the compile text says, what a torch
# without the flag lacks)
_INDUCTOR_SWITCHES = (
    ("autotune_reductions", "triton", "mix_order_reduction_autotune_split_size",
     "mix-order reduction split sizes autotuned", "mix-order reductions"),
    ("pdl", "triton", "enable_pdl", "programmatic dependent launch",
     "programmatic dependent launch"),
    ("combo_kernels", "", "combo_kernels", "combo kernels", "combo kernels"))


def _inductor_switches(state: TrainState) -> str:
    """Turn on the Inductor options of the recipe's switches (autotune_reductions, pdl,
    combo_kernels) for this run only; the text that says which, with a warning for each that
    cannot be."""
    r = state.recipe
    wanted = [s for s in _INDUCTOR_SWITCHES if getattr(r, s[0])]
    if not wanted:
        return ""
    import torch._inductor.config as inductor_config

    done = ""
    for name, path, flag, says, feature in wanted:
        obj = getattr(inductor_config, path) if path else inductor_config
        why = ("needs the inductor backend" if r.compile_backend != "inductor" else
               f"this torch ({torch.__version__}) has no {feature}" if not hasattr(obj, flag)
               else None)
        if name == "pdl" and why is None:
            dev = state.device
            why = (None if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9
                   else f"needs a GPU of compute capability 9.0 or newer, not {dev}")
        if why:
            state.idle(name, f"{why}; left off")
            continue
        state.set_flag(obj, flag, True)
        done += f"; {says}"
    return done


def cache_file(state: TrainState) -> Path:
    """The compile cache of this run: one file per workload, batch, recipe, torch, triton and
    GPU (compiled kernels are specific to all of them)."""
    from ..measure.env import software
    from ..measure.files import cache_root

    key = {"workload": state.workload.describe(), "micro_batch": state.micro_batch,
           "recipe": state.recipe.to_dict(), **software(state.device)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "compile" / f"{state.workload.name}-{digest}.bin"


def _entries(info) -> int:
    return sum(len(v) for v in getattr(info, "artifacts", {}).values())


def _load_cache(state: TrainState) -> str:
    """Load this run's compile cache before anything compiles; the text that says what happened."""
    if not state.recipe.compile_cache:
        return ""
    path = cache_file(state)
    if not path.is_file():
        return f"; compile cache: none yet at {path} (saved after this run)"
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as err:  # a cache from another torch build: compile from scratch
        state.warn("compile", f"compile cache {path} could not be loaded "
                   f"({type(err).__name__}: {str(err)[:80]}); compiling from scratch")
        return ""
    return f"; compile cache: {_entries(info)} entries loaded from {path}"


def save_cache(state: TrainState) -> str | None:
    """After a run with ``compile_cache``: write what torch.compile made to the cache file
    (atomically; rank 0 only); the text that says so, or None when there is nothing to do."""
    from ..distributed import env as dist_env

    if not state.recipe.compile_cache or state.recipe.compile == "none" \
            or not dist_env.current().main:
        return None
    got = torch.compiler.save_cache_artifacts()
    if got is None:
        state.warn("compile", "compile cache: torch.compile reported nothing to save")
        return None
    data, info = got
    from ..measure.files import write_atomic

    path = cache_file(state)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    return f"compile cache: {_entries(info)} entries ({len(data) / 1e6:.1f} MB) saved to {path}"


BREAK_REASONS = 8
"""How many graph-break reasons a run's row keeps (the most frequent, each cut to 240
characters): a break in a repeated block costs every block, and its reason says where."""


def graph_stats(since: dict | None = None) -> dict:
    """Dynamo's counters: graphs compiled, graph breaks, recompiles — since ``since`` — and
    ``break_reasons``: the breaks' reasons with their counts (the most frequent
    ``BREAK_REASONS``)."""
    from torch._dynamo.utils import counters

    limit = ("recompile limit", "recompile_limit", "cache_size_limit", "cache size limit")
    now = {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
           "graph_breaks": int(sum(counters["graph_break"].values())),
           "recompiles": int(counters["recompiles"].get("total", 0)
                             if "recompiles" in counters else 0),
           # a function that kept changing shape until dynamo gave up: the rest ran eager
           "recompile_limit_hits": int(sum(n for reason, n in counters["unimplemented"].items()
                                           if any(k in reason.lower() for k in limit)))}
    out: dict = {k: v - (since or {}).get(k, 0) for k, v in now.items()}
    before = (since or {}).get("break_reasons", {})
    reasons: dict[str, int] = {}
    for reason, n in counters["graph_break"].items():
        key = str(reason)[:240]
        reasons[key] = reasons.get(key, 0) + int(n)
    grown = {r: n - before.get(r, 0) for r, n in reasons.items() if n > before.get(r, 0)}
    out["break_reasons"] = dict(sorted(grown.items(), key=lambda kv: -kv[1])[:BREAK_REASONS]) \
        if since is not None else reasons
    return out


def limit_warning(stats: dict[str, int] | None) -> str | None:
    """A line for the row's warnings when compile gave up on a function."""
    if not stats or not stats.get("recompile_limit_hits"):
        return None
    return (f"dynamo's recompile limit was hit ({stats['unique_graphs']} graphs compiled): "
            "later shapes ran eager; if batch shapes vary, pad them (pad_multiple)")


def finish(state: TrainState) -> None:
    """After the timed steps: dynamo's counters for this run (a warning where it gave up on a
    function), and the compile cache saved where the recipe asks."""
    state.compile_stats = graph_stats(state.compile_baseline)
    if limit_warning(state.compile_stats):
        state.warn("compile", limit_warning(state.compile_stats))
    saved = save_cache(state)
    if saved:
        state.note("compile", saved)


TECHNIQUE = Technique(
    name="compile", phase=Phase.COMPILE, summary="torch.compile: whole model | regional blocks",
    changes_numerics=False, apply=apply, active=lambda r: r.compile != "none", finish=finish,
    example={"compile": "regional", "compile_backend": "eager"})
