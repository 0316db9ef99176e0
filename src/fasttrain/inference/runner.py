"""Run the inference ladder: the fp32 reference, the PyTorch peers, then fasttrain's rungs, each
in its own process; rows appended as they finish, each compared with the peer.

A rung's row carries ``x_peer`` (its throughput over the ``torch.compile(reduce-overhead)``
peer's, measured in the same run) and ``latency_x_peer`` (its batch-1 p50 over the peer's:
below 1 is faster). A rung that fails its accuracy gate, errors or is skipped gets neither.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import FasttrainError
from ..measure.env import environment
from ..measure.rows import append_row
from ..run.child import ChildSpec, run_in_child
from ..run.loop import load_dataset
from ..workloads import load_workload
from .model import require_classifier
from .spec import PEERS, REFERENCE, InferRung, InferSpec, rungs_named

PEER = "peer-compile"
"""The peer every rung is compared against: the best a user gets from PyTorch alone."""

OnRow = Callable[[dict, int, int], None]


@dataclass
class InferLadder:
    """What ``fasttrain infer`` runs."""

    workload: str
    size: str = "tiny"
    rungs: list[str] = field(default_factory=lambda: ["default"])
    device: str = "cpu"
    batch: int = 64
    images: int = 1024
    iters: int = 50
    warmup: int = 10
    data: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None
    peer: bool = True
    out: Path = Path("out/infer.jsonl")
    timeout: float | None = 900.0
    """Seconds a rung may take (compile included) before it is stopped and reported."""


def check(spec: InferLadder) -> list[InferRung]:
    """Refuse what cannot run, before any process starts; the rungs to run."""
    for name, value in (("--batch", spec.batch), ("--images", spec.images),
                        ("--iters", spec.iters)):
        if value < 1:
            raise FasttrainError(f"{name} must be a positive number, not {value}")
    if spec.warmup < 0:
        raise FasttrainError(f"--warmup must be 0 or more, not {spec.warmup}")
    rungs = rungs_named(spec.rungs)
    wl = load_workload(spec.workload, spec.size, seed=0, data=spec.data, **spec.options)
    require_classifier(wl, spec.workload)
    if spec.data is not None:  # a wrong data path is refused once, not by every rung
        load_dataset(wl)
    if spec.checkpoint is not None:
        _check_checkpoint(Path(spec.checkpoint), wl)
    return rungs


def _check_checkpoint(folder: Path, wl) -> None:
    """A ``--checkpoint`` that is no ``fasttrain train --save`` folder of this workload and
    size, refused from its record alone (the weights are read by each rung)."""
    from ..run.checkpoint import META, resolve

    if not folder.is_dir():
        raise FasttrainError(f"--checkpoint {folder}: no such folder (give a fasttrain train "
                             "--save folder)")
    folder = resolve(folder)  # its newest complete save; a folder with none is refused
    try:
        meta = json.loads((folder / META).read_text())
    except FileNotFoundError:
        raise FasttrainError(f"--checkpoint {folder}: no fasttrain checkpoint in it (give a "
                             "fasttrain train --save folder)") from None
    except (ValueError, UnicodeDecodeError):
        meta = None
    if not isinstance(meta, dict):
        raise FasttrainError(f"--checkpoint {folder}: its {META} is damaged (not a fasttrain "
                             "checkpoint's JSON record)")
    saved = meta.get("workload")
    if saved and list(saved) != [wl.name, wl.size]:
        raise FasttrainError(f"--checkpoint {folder} holds a {' '.join(saved)} checkpoint, "
                             f"this run is {wl.name} {wl.size}")


def rung_spec(spec: InferLadder, rung: InferRung, workdir: Path) -> InferSpec:
    """What one process of ``spec``'s ladder runs for ``rung`` (measured or exported)."""
    return InferSpec(workload=spec.workload, size=spec.size, rung=asdict(rung),
                     device=spec.device, batch=spec.batch, images=spec.images, iters=spec.iters,
                     warmup=spec.warmup, data=spec.data, options=spec.options,
                     checkpoint=spec.checkpoint, workdir=str(workdir))


def _child(spec: InferLadder, rung: InferRung, workdir: Path) -> ChildSpec:
    job = rung_spec(spec, rung, workdir)
    return ChildSpec(job="fasttrain.inference.job:infer_job", workload=spec.workload,
                     size=spec.size, device=spec.device, data=spec.data, options=spec.options,
                     batch=spec.batch, job_args=job.to_dict())


def compare_to_peer(row: dict, peer: dict | None) -> dict:
    """``x_peer`` and ``latency_x_peer`` where both rows measured and the rung passed."""
    ok = (peer is not None and not peer.get("error") and not peer.get("skipped")
          and not row.get("error") and not row.get("skipped") and row.get("peer") is None
          and (row.get("accuracy") or {}).get("passed"))
    if not ok:
        return row
    row = {**row, "x_peer": row["throughput"] / peer["throughput"]}
    if row.get("latency_ms") and peer.get("latency_ms"):
        row["latency_x_peer"] = row["latency_ms"]["p50"] / peer["latency_ms"]["p50"]
    return row


def run_infer(spec: InferLadder, on_row: OnRow | None = None,
              workdir: Path | None = None) -> list[dict]:
    """Every rung and peer, in order; the rows (also appended to ``spec.out``). ``workdir``
    keeps the held-out images and the fp32 logits the rungs share (a temporary folder when
    None; ``export_best`` needs it after the ladder)."""
    rungs = check(spec)
    plan = rungs[:1] + (list(PEERS.values()) if spec.peer else []) + rungs[1:]
    env = environment(spec.device)
    spec.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="fasttrain-infer-") as tmp:
        work = Path(workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        peer = None
        for i, rung in enumerate(plan):
            row = run_in_child(_child(spec, rung, work), work, rung.name, timeout=spec.timeout)
            row = {"kind": "inference", "workload": spec.workload, "size": spec.size,
                   "rung": rung.name, "peer": rung.peer, **row}
            if rung.name == REFERENCE and row.get("error"):
                row["error"] = f"the fp32 reference failed, nothing to compare with: {row['error']}"
            if rung.name == PEER:
                peer = row
            row = compare_to_peer(row, peer)
            row["env"] = env
            append_row(spec.out, row)
            rows.append(row)
            if on_row:
                on_row(row, i, len(plan))
            if rung.name == REFERENCE and row.get("error"):
                break  # every other rung would fail for want of the reference
    return rows


def failed(rows: list[dict]) -> list[dict]:
    """Rows that make ``fasttrain infer`` exit 1: an error, or a rung below the accuracy gate."""
    return [r for r in rows if r.get("error") or (
        not r.get("skipped") and (r.get("accuracy") or {}).get("passed") is False)]
