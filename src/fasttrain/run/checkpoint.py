"""Checkpoints with torch.distributed.checkpoint (DCP).

``save`` writes each rank's shards (model, optimizer, EMA) into one folder plus a small JSON of
the step and schedule (written by rank 0, atomically); ``load`` reads them back into a model of
any world size and sharding — DCP reshards on load; ``export`` consolidates a folder into one
``torch.save`` file for inference or other tools. The data stream resumes at the saved step, so a
resumed run sees the batches the uninterrupted run would have.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..distributed import env as dist_env
from ..errors import FasttrainError, describe_error
from ..measure.files import write_atomic
from ..techniques.base import TrainState

META = "fasttrain.json"


def check(state: TrainState) -> None:
    """Refuse what save/resume cannot handle, before any step runs."""
    if not isinstance(state.optimizer, torch.optim.Optimizer) or state.zero1:
        raise FasttrainError("checkpoints need a plain or FSDP2-sharded optimizer; offload, "
                             "bf16-true's master_weights and zero1 are not supported for "
                             "save/resume yet")


def check_folder(folder: str | Path) -> None:
    """A checkpoint goes into a folder this user can write: refused before the run, not after."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise FasttrainError(f"checkpoint folder {folder} is a file: give a folder to save into")
    parent = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FasttrainError(f"cannot write a checkpoint into {folder}: {parent} is not "
                             "writable; give a folder you can write")


def _masters(state: TrainState) -> dict[str, torch.Tensor]:
    """The fp32 masters of bf16 weights (bf16-mixed master_weights) by the weights' state-dict
    names: the model's entries hold them, so a checkpoint (and its export) has fp32 weights,
    and loading copies them into the masters in place and, rounded, into the bf16 weights."""
    opt = state.optimizer
    masters = getattr(opt, "masters", None)
    if not masters:
        return {}
    by_id = {id(p): m for p, m in zip(opt.params, masters) if m is not None}
    return {name.replace("_orig_mod.", ""): by_id[id(p)]
            for name, p in state.model.named_parameters(remove_duplicate=False) if id(p) in by_id}


def _state(state: TrainState) -> dict:
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    masters = _masters(state)
    model_sd = {k: masters.get(k, v) for k, v in model_sd.items()}
    out = {"model": model_sd, "optim": optim_sd}
    if state.ema is not None:
        out["ema"] = {f"{i}": t for i, t in enumerate(state.ema.shadow)}
    return out


def save(state: TrainState, folder: str | Path, step: int) -> Path:
    check(state)
    folder = Path(folder)
    if state.ema is not None:
        state.ema.synchronize()
    dcp.save(_state(state), checkpoint_id=str(folder))
    if dist_env.current().main:
        meta = {"step": step, "recipe": state.recipe.to_dict(),
                "workload": [state.workload.name, state.workload.size],
                "scheduler": state.scheduler.state_dict() if state.scheduler else None,
                "world": dist_env.current().world}
        write_atomic(folder / META, json.dumps(meta))
    dist_env.barrier("checkpoint save", state.recipe.dist_timeout)
    return folder


def load(state: TrainState, folder: str | Path) -> int:
    """Restore model, optimizer, EMA and schedule; returns the step to continue from."""
    check(state)
    folder = Path(folder)
    if not (folder / META).is_file():
        raise FasttrainError(f"no fasttrain checkpoint in {folder}")
    meta = json.loads((folder / META).read_text())
    saved, now = meta.get("recipe", {}), state.recipe.to_dict()
    was, this = meta.get("workload"), [state.workload.name, state.workload.size]
    if was and was != this:
        raise FasttrainError(f"resume: {folder} holds a {' '.join(was)} checkpoint, this run is "
                             f"{' '.join(this)}: resume it with the workload and size that saved it")
    # the data position and the state layout depend on these
    for key in ("batch", "ema", "optimizer", "accumulation", "precision", "master_weights"):
        if key in saved and saved[key] != now[key]:
            raise FasttrainError(f"resume: the checkpoint has {key}={saved[key]!r}, this run "
                                 f"{key}={now[key]!r}")
    target = _state(state)
    try:
        dcp.load(target, checkpoint_id=str(folder))
    except (RuntimeError, KeyError, ValueError) as err:  # a checkpoint of another model
        raise FasttrainError(f"resume: {folder} does not fit this model "
                             f"({describe_error(err, 120)}): resume it with the workload, size "
                             "and options that saved it") from None
    # loading a param group replaces its implementation flags with the saved run's: keep this
    # run's (fused, foreach, capturable), or a resume under another optimizer_impl runs slower
    flags = [{k: g[k] for k in ("fused", "foreach", "capturable") if k in g}
             for g in state.optimizer.param_groups]
    set_state_dict(state.model, state.optimizer, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])
    for group, kept in zip(state.optimizer.param_groups, flags):
        group.update(kept)
    if state.ema is not None:
        for i, t in enumerate(state.ema.shadow):
            t.copy_(target["ema"][f"{i}"])
    step = int(meta["step"])
    if state.scheduler is not None and meta.get("scheduler"):
        state.scheduler.load_state_dict(meta["scheduler"])
        if hasattr(state.scheduler, "T_max"):  # the cosine horizon extends to this run's end
            state.scheduler.T_max = step + state.total_steps
    return step


def export(folder: str | Path, file: str | Path) -> Path:
    """One consolidated ``torch.save`` file from a DCP folder (run in one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not (Path(folder) / META).is_file():
        raise FasttrainError(f"no fasttrain checkpoint in {folder}")
    dcp_to_torch_save(str(folder), str(file))
    return Path(file)
