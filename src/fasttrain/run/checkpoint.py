"""Checkpoints with torch.distributed.checkpoint (DCP).

``save`` writes each rank's shards (model, optimizer, EMA) plus a small JSON of the step and
schedule into a new step folder of the ``--save`` folder, published whole (``step_folders``: a
kill mid-save never touches the earlier saves); ``load`` reads the newest complete one back into
a model of any world size and sharding — DCP reshards on load; ``export`` consolidates one into
a ``torch.save`` file for inference or other tools. The data stream resumes at the saved step, so a
resumed run sees the batches the uninterrupted run would have.

Nothing read from a checkpoint folder can run code: DCP's ``.metadata`` is a pickle, so it is
first read with an unpickler that builds only the classes DCP's metadata is made of (and refused
in one line otherwise), and the non-tensor entries (learning rates, betas, flags) are read with
``torch.load(weights_only=True)`` instead of DCP's default plain unpickling.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ..distributed import env as dist_env
from ..errors import FasttrainError, describe_error
from ..measure.files import torch_save, write_atomic
from ..techniques.base import TrainState
from ..techniques.optimizer import continue_schedule, schedule_record
from . import named_state, step_folders
from .step_folders import DCP_META, META


def check(state: TrainState) -> None:
    """Refuse what save/resume cannot handle, before any step runs."""
    if not isinstance(state.optimizer, (torch.optim.Optimizer, named_state.ShadowOptimizer)):
        raise FasttrainError(f"checkpoints need a plain, zero1-, FSDP2-sharded, offloaded or "
                             f"master-weight optimizer, not {type(state.optimizer).__name__}: "
                             "not supported for save/resume")


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


def _state(state: TrainState, h: named_state.Holder | None,
           meta: dcp_metadata.Metadata | None = None) -> dict:
    """What a checkpoint holds. ``h``: the optimizer state kept by name, if any (``meta``: the
    checkpoint being loaded, from which the entries this rank reads are allocated)."""
    if h is not None:  # each rank its own entries, by parameter name
        model_sd = get_model_state_dict(state.model)
        copies = named_state.weights(state.model, state.optimizer)  # fp32, loaded in place
        out = {"model": {k: copies.get(k, v) for k, v in model_sd.items()},
               h.prefix: named_state.saved(h) if meta is None else named_state.targets(h, meta)}
    else:
        model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
        masters = _masters(state)
        model_sd = {k: masters.get(k, v) for k, v in model_sd.items()}
        for group in optim_sd.get("param_groups", []):  # the state dict's own dicts
            # the scheduler's own key: saved and loaded by neither side, so that a run with a
            # schedule resumes from a checkpoint saved without one (load keeps this run's)
            group.pop("initial_lr", None)
            if isinstance(group.get("lr"), torch.Tensor):
                # a device rate (the one-launch AdamW's, a capturable AdamW's under a schedule)
                # is saved, and loaded, as a number: any optimizer can resume from it, and a
                # load never writes into the live tensor
                group["lr"] = float(group["lr"])
        out = {"model": model_sd, "optim": optim_sd}
    if state.ema is not None:
        out["ema"] = {f"{i}": t for i, t in enumerate(state.ema.shadow)}
    return out


def save(state: TrainState, folder: str | Path, step: int, keep: int = 0) -> Path:
    """Checkpoint ``step`` into a new step folder of ``folder`` (every rank calls it), published
    only once every rank's files are written; ``keep``: then remove all but the newest ``keep``
    step folders (0 keeps all). Returns the published folder (``folder`` on ranks other than 0)."""
    check(state)
    root, main, timeout = Path(folder), dist_env.current().main, state.recipe.dist_timeout
    if state.ema is not None:
        state.ema.synchronize()
    if main:
        step_folders.begin(root, step)
    dist_env.barrier("checkpoint save", timeout)
    h = named_state.holder(state.model, state.optimizer, state.zero1)
    with _one_process_is_meant():
        dcp.save(_state(state, h), checkpoint_id=str(step_folders.temp_folder(root, step)))
    dist_env.barrier("checkpoint save", timeout)  # every rank's files are written and synced
    published = root
    if main:
        meta = {"step": step, "recipe": _effective(state.recipe.to_dict(), state),
                "workload": [state.workload.name, state.workload.size],
                "schedule": schedule_record(state.scheduler),
                "world": dist_env.current().world, "optimizer_state": h.prefix if h else "dcp"}
        published = step_folders.publish(root, step_folders.temp_folder(root, step), step,
                                         json.dumps(meta))
        if keep:
            step_folders.prune(root, keep)
    dist_env.barrier("checkpoint save", timeout)
    return published


# What DCP's Metadata pickle is made of (found by reading real checkpoints' .metadata): its
# dataclasses, the storage index, paths, torch.Size, dtypes and layouts. Names with a dot are
# refused: pickle resolves "Path.touch" or "torch.load" as attributes, a way to reach a function.
_METADATA_CLASSES = {n for n, o in vars(dcp_metadata).items()
                     if isinstance(o, type) and o.__module__ == dcp_metadata.__name__}
_ALLOWED = {
    dcp_metadata.__name__: _METADATA_CLASSES,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the classes DCP's metadata holds; anything else is refused, never called."""

    def find_class(self, module: str, name: str):
        torch_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if "." not in name and (torch_dtype or (module, name) == ("torch", "Size")
                                or name in _ALLOWED.get(module, ())):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata never holds")


def _read_metadata(path: str | Path) -> dcp_metadata.Metadata:
    """DCP's Metadata from ``path`` through the restricted unpickler; a one-line refusal else."""
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise FasttrainError(f"no DCP metadata ({path}) in this checkpoint folder") from None
    except Exception as err:  # noqa: BLE001 - a crafted or damaged file: refused, whatever it is
        raise FasttrainError(f"resume: {path} is not a DCP checkpoint's metadata "
                             f"({describe_error(err, 120)}): it will not be loaded") from None
    if not isinstance(meta, dcp_metadata.Metadata):
        raise FasttrainError(f"resume: {path} holds a {type(meta).__name__}, not DCP's "
                             "metadata: it will not be loaded")
    return meta


def _whole(folder: Path) -> bool:
    """Every file DCP's metadata names is there and long enough (a torn folder is not). A
    metadata file that is not DCP's is refused here, not passed over: that is no torn save."""
    if not ((folder / META).is_file() and (folder / DCP_META).is_file()):
        return False
    for info in _read_metadata(folder / DCP_META).storage_data.values():
        path = folder / info.relative_path
        if not path.is_file() or path.stat().st_size < info.offset + info.length:
            return False
    return True


def resolve(folder: str | Path) -> Path:
    """The save a ``--save`` folder (its newest complete step folder), a step folder or an
    old-style checkpoint folder names; refused in one line when none is complete."""
    return step_folders.resolve(folder, _whole)


def latest(folder: str | Path) -> Path | None:
    """The newest complete save of a ``--save`` folder, or None where it holds none yet (it does
    not exist, is empty, or its only saves were cut off): ``--resume auto``'s choice."""
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        return None
    try:
        return resolve(folder)
    except FasttrainError:
        if step_folders.step_folders(folder) or not (folder / step_folders.META).is_file():
            return None  # only cut-off saves, or nothing of fasttrain's: nothing to continue
        raise


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read through the restricted unpickler."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        meta = _read_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp_metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class _PlainData:
    """A load planner's non-tensor entries (lr, betas, flags) through ``weights_only=True``:
    DCP's default unpickles them with ``weights_only=False``, which runs what they name."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            data = torch.load(value, weights_only=True)
        except Exception as err:  # noqa: BLE001 - a crafted entry: refused, never run
            raise FasttrainError(f"resume: the checkpoint's entry {read_item.dest_index.fqn} "
                                 f"is not plain data ({describe_error(err, 80)}): it will not "
                                 "be loaded") from None
        super().load_bytes(read_item, io.BytesIO(_saved(data)))


def _saved(data) -> bytes:
    """``data`` (built by the safe loader, so plain) serialized again for DCP's own load_bytes,
    which unpickles it without restriction: what it reads now holds only what was allowed."""
    buf = io.BytesIO()
    torch.save(data, buf)
    return buf.getvalue()


class _SafePlanner(_PlainData, DefaultLoadPlanner):
    pass


class _SafeExportPlanner(_PlainData, _EmptyStateDictLoadPlanner):
    pass


@contextlib.contextmanager
def _one_process_is_meant():
    """DCP warns that it "assumes the intent is to save in a single process" whenever no process
    group is up; for a run of one process that is the intent, so the warning is only noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable "
                                "or uninitialized", category=UserWarning)
        yield


def _dcp_load(target: dict, folder: Path, planner, whole: bool = False) -> None:
    """``dcp.load`` that runs nothing from the folder; DCP's wrapped refusals come out as ours.
    ``whole``: fill the empty ``target`` with everything, in this process (dcp_to_torch_save's
    way: ``dcp.load`` would fill a copy of it)."""
    _read_metadata(folder / DCP_META)  # every rank, before DCP reads anything
    reader = _SafeReader(str(folder))
    try:
        if whole:
            _load_state_dict(target, storage_reader=reader, planner=planner, no_dist=True)
        else:
            with _one_process_is_meant():
                dcp.load(target, storage_reader=reader, planner=planner)
    except CheckpointException as err:
        for exc, _ in err.failures.values():
            if isinstance(exc, FasttrainError):
                raise exc from None
        first = next(iter(err.failures.values()))[0]
        raise RuntimeError(describe_error(first, 200)) from None


_LAYOUTS = {"dcp": "the optimizer's own (DCP's state dict)",
            "zero1": "sharded by zero1 (each rank its partition)",
            "shadow": "an offloaded or master-weight optimizer's (fp32 copies)"}
"""How a checkpoint's optimizer state is laid out (its record's ``optimizer_state``)."""


def _effective(recipe: dict, state: TrainState) -> dict:
    """A recipe's record with the values the run really used where it left them to the
    workload (batch 0: the workload's batch; lr 0: its reference lr)."""
    out = {**recipe, "batch": state.workload.batch_of(recipe.get("batch", 0))}
    if "lr" in out:
        out["lr"] = state.workload.lr_of(out["lr"])
    return out


def load(state: TrainState, folder: str | Path) -> int:
    """Restore model, optimizer, EMA and schedule; returns the step to continue from."""
    check(state)
    folder = resolve(folder)
    dist_env.agree("the checkpoint to resume", str(folder))
    try:
        meta = json.loads((folder / META).read_text())
    except (ValueError, UnicodeDecodeError):
        meta = None
    if not isinstance(meta, dict):
        raise FasttrainError(f"resume: {folder / META} is damaged (not a fasttrain checkpoint's "
                             "JSON record): save the checkpoint again") from None
    saved = _effective(meta.get("recipe", {}), state)
    now = _effective(state.recipe.to_dict(), state)
    was, this = meta.get("workload"), [state.workload.name, state.workload.size]
    if was and was != this:
        raise FasttrainError(f"resume: {folder} holds a {' '.join(was)} checkpoint, this run is "
                             f"{' '.join(this)}: resume it with the workload and size that saved it")
    # the data position and the state layout depend on these
    for key in ("batch", "ema", "optimizer", "accumulation", "precision", "master_weights"):
        if key in saved and saved[key] != now[key]:
            raise FasttrainError(f"resume: the checkpoint has {key}={saved[key]!r}, this run "
                                 f"{key}={now[key]!r}: resume with --set {key}={saved[key]}, "
                                 "or start a new run (without --resume)")
    h = named_state.holder(state.model, state.optimizer, state.zero1)
    layout, now_layout = meta.get("optimizer_state", "dcp"), h.prefix if h else "dcp"
    if layout != now_layout:  # by name (zero1's partitions, a shadow's copies) or DCP's own
        raise FasttrainError(f"resume: the checkpoint's optimizer state is "
                             f"{_LAYOUTS.get(layout, repr(layout))}, this run's is "
                             f"{_LAYOUTS[now_layout]}: resume it with the sharding, offload and "
                             "master_weights that saved it")
    # loading a param group replaces its implementation flags and learning rate with the saved
    # run's: keep this run's flags (fused, foreach, capturable; or a resume under another
    # optimizer_impl runs slower) and lr (this run's schedule sets it, below), and the settings
    # the saved run's optimizer did not have (the one-launch AdamW's groups lack PyTorch
    # AdamW's decoupled_weight_decay, say). A rate on the device stays the same tensor (a
    # captured step reads it), with this run's value.
    kept_keys = ("fused", "foreach", "capturable", "initial_lr")
    kept = [{k: g[k] for k in kept_keys if k in g} for g in state.optimizer.param_groups]
    rates = [(g["lr"], float(g["lr"])) for g in state.optimizer.param_groups]
    dcp_meta = _read_metadata(folder / DCP_META)
    target = _state(state, h, dcp_meta if h else None)
    unsaved = {}
    if h is None:  # another AdamW implementation: what its groups lack keeps this run's value
        for i, (group, mine) in enumerate(zip(target["optim"].get("param_groups", []), kept)):
            for key in [k for k in group if k != "params"]:
                if f"optim.param_groups.{i}.{key}" not in dcp_meta.state_dict_metadata:
                    mine[key] = state.optimizer.param_groups[i][key]
                    del group[key]
        unsaved = _unsaved_masters(target, dcp_meta)
    try:
        _dcp_load(target, folder, _SafePlanner())
    except (RuntimeError, KeyError, ValueError) as err:  # a checkpoint of another model
        raise FasttrainError(f"resume: {folder} does not fit this model "
                             f"({describe_error(err, 120)}): resume it with the workload, size "
                             "and options that saved it") from None
    if h is not None:
        set_model_state_dict(state.model, target["model"])  # a shadow's fp32 copies, rounded
        named_state.restore(h, target[h.prefix])
    else:
        loaded = {name: target["model"][name].detach().clone() for name in unsaved}
        set_state_dict(state.model, state.optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optim"])
        with torch.no_grad():  # the fp32 values the model entries brought, not the rounded
            for name, master in unsaved.items():  # weights the optimizer's load copied
                master.copy_(loaded[name])
    for group, mine, (live, value) in zip(state.optimizer.param_groups, kept, rates):
        group.update(mine)
        if isinstance(live, torch.Tensor):
            live.fill_(value)
        group["lr"] = live
    if state.ema is not None:
        for i, t in enumerate(state.ema.shadow):
            t.copy_(target["ema"][f"{i}"])
    step = int(meta["step"])
    continue_schedule(state, meta.get("schedule") or meta.get("scheduler"), step)
    return step


def _unsaved_masters(target: dict, dcp_meta) -> dict[str, torch.Tensor]:
    """The fp32 masters this run keeps that the checkpoint has no optimizer entry for (an
    embedding that feeds a bf16 residual stream has one under master_weights since fasttrain
    stores it in bf16; a run saved before, or with stream_dtype=auto, kept it in fp32): taken
    out of the target, by the model entry's name. The model entry itself, which holds the
    master, still loads the saved fp32 weight into it."""
    out = {}
    for name, entry in target["optim"].get("state", {}).items():
        if "master" in entry and f"optim.state.{name}.master" not in \
                dcp_meta.state_dict_metadata and name in target["model"]:
            out[name] = entry.pop("master")
    return out


def export(folder: str | Path, file: str | Path) -> Path:
    """One consolidated ``torch.save`` file from a checkpoint (``resolve``), in one process."""
    folder = resolve(folder)
    full: dict = {}  # what dcp_to_torch_save does, through the safe reader and planner
    _dcp_load(full, folder, _SafeExportPlanner(), whole=True)
    return write_atomic(file, lambda tmp: torch_save(full, tmp))  # never a half file


def model_weights(folder: str | Path, workload=None) -> dict[str, torch.Tensor]:
    """The model's weights of a checkpoint (``resolve``; fp32 masters where the run kept them), by
    their state-dict names, read in this process; ``workload``: refuse a folder saved by
    another workload or size, in one line."""
    try:
        folder = resolve(folder)
    except FasttrainError as err:
        raise FasttrainError(f"{err} (give a fasttrain train --save folder)") from None
    meta = json.loads((folder / META).read_text())
    if workload is not None and list(meta.get("workload", [])) != [workload.name, workload.size]:
        saved = " ".join(meta.get("workload", ["?"]))
        raise FasttrainError(f"checkpoint {folder} holds {saved}, not {workload.name} "
                             f"{workload.size}")
    # only the model's tensors are read (not the optimizer's, twice their size): the target
    # is built from the metadata's entries under "model."
    entries = _read_metadata(folder / DCP_META).state_dict_metadata
    target = {"model": {fqn[len("model."):]: torch.empty(tuple(md.size),
                                                        dtype=md.properties.dtype)
                        for fqn, md in entries.items()
                        if fqn.startswith("model.") and hasattr(md, "size")}}
    _dcp_load(target, folder, _SafePlanner(), whole=True)
    return {k.replace("_orig_mod.", ""): v for k, v in target["model"].items()}
