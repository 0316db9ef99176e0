"""The deployable artifact: the fastest passing rung as an AOTInductor package.

``export_best`` tries the rungs that passed their accuracy gate, fastest first: each is built
in a fresh process exactly as measured but without ``torch.compile`` (AOTInductor compiles the
exported graph itself), exported with ``torch.export`` with a dynamic batch dimension, and
packaged with ``torch._inductor.aoti_compile_and_package``. The package is then loaded in
another fresh process that imports torch only (``serve_check.py``, run by path), which runs the
held-out images and times the package; its logits are checked against the fp32 reference like
any rung. The file appears only when all of that passed (written beside, then renamed).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import FasttrainError, describe_error
from ..measure.env import environment
from ..measure.rows import append_row, blank_row
from ..run.child import ChildSpec, run_in_child
from ..workloads import load_workload
from . import bench
from .model import load_classifier, prepare
from .runner import InferLadder, compare_to_peer, rung_spec
from .spec import RUNGS, InferSpec

CHECK_SCRIPT = Path(__file__).with_name("serve_check.py")
MAX_BATCH = 1024
# faulthandler's frames of torch's own package loading: a crash there is torch's, not the model's
LOADER_FRAMES = (" in _load_aoti", " in aoti_load_package", " in aot_load")


class LoaderCrash(FasttrainError):
    """The torch-only process died inside torch's own package loader, before the model ran: any
    other rung's package would meet the same loader, so no other rung is tried."""


def export_job(child: ChildSpec) -> dict:
    """Export one rung (``job_args``: an InferSpec and ``package``) as an AOTInductor package."""
    args = dict(child.job_args)
    package = Path(args.pop("package"))
    spec = InferSpec(**args)
    rung = spec.rung_config()
    # AOTInductor compiles it; capturing it in CUDA graphs is the server's business
    rung = replace(rung, compile=None, capture=False)
    device = torch.device(spec.device)
    wl = load_workload(spec.workload, spec.size, seed=0, data=spec.data, **spec.options)
    images, _ = bench.eval_images(wl, spec.images, Path(spec.workdir))
    with torch.inference_mode():
        model, applied = prepare(load_classifier(wl, spec.checkpoint), rung, device)
    x = images[:spec.batch].to(device)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    from torch._inductor import aoti_compile_and_package

    aoti_compile_and_package(program, package_path=str(package))
    return {"applied": applied, "error": None}


def check_package(package: Path, workdir: Path, batch: int, iters: int, warmup: int,
                  device: str, timeout: float | None) -> dict:
    """Load ``package`` in a process that imports torch only; its logits and timings."""
    out = workdir / "serve-check.pt"
    cmd = [sys.executable, str(CHECK_SCRIPT), str(package), str(workdir / bench.EVAL_FILE),
           str(out), str(batch), str(iters), str(warmup), device]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        fatal = next((ln for ln in lines if ln.startswith("Fatal Python error")), None)
        if proc.returncode < 0:  # killed by a signal: say which, and where faulthandler saw it
            try:
                what = f"its process died of {signal.Signals(-proc.returncode).name}"
            except ValueError:  # a real-time signal has no name
                what = f"its process died of signal {-proc.returncode}"
            frames = [ln.strip() for ln in lines if ln.strip().startswith("File ")]
            if any(f.endswith(name) for f in frames for name in LOADER_FRAMES):
                raise LoaderCrash(
                    f"the exported package did not run on its own: {what} inside torch's "
                    "AOTInductor loader; the other rungs' rows stand (docs/inference.md, "
                    "'When the package does not load')")
            raise FasttrainError(f"the exported package did not run on its own: {what}"
                                 + (f" ({fatal[:160]})" if fatal else ""))
        raise FasttrainError(f"the exported package did not run on its own: "
                             f"{(fatal or (lines[-1] if lines else str(proc.returncode)))[:200]}")
    return torch.load(out, weights_only=True)


def _export_row(spec: InferLadder, source: dict, package: Path, workdir: Path) -> dict:
    """Export ``source``'s rung to ``package``, check it; the export row (error on failure)."""
    row = blank_row("inference", spec.workload, spec.size, "export", peer=None,
                    exported_from=source["rung"], batch=spec.batch, throughput_unit="img/s",
                    latency_ms=None, accuracy=None, package=str(package))
    rung = RUNGS[source["rung"]]
    job = rung_spec(spec, rung, workdir)
    partial = package.with_name(package.stem + ".partial.pt2")  # AOTInductor wants .pt2
    child = ChildSpec(job="fasttrain.inference.export:export_job", workload=spec.workload,
                      size=spec.size, device=spec.device,
                      job_args={**job.to_dict(), "package": str(partial)})
    done = run_in_child(child, workdir, f"export-{rung.name}", timeout=spec.timeout)
    if done.get("error"):
        partial.unlink(missing_ok=True)
        return {**row, "error": f"export of {rung.name} failed: {done['error']}"}
    try:
        got = check_package(partial, workdir, spec.batch, spec.iters, spec.warmup, spec.device,
                            spec.timeout)
    except (FasttrainError, subprocess.TimeoutExpired) as err:
        partial.unlink(missing_ok=True)
        return {**row, "error": f"export of {rung.name}: {describe_error(err)}",
                "loader_crash": isinstance(err, LoaderCrash)}
    ref = bench.load_reference(workdir)
    labels = torch.load(workdir / bench.EVAL_FILE, weights_only=True)["labels"]
    acc = bench.accuracy(got["logits"], ref["logits"],
                         labels if spec.data is not None else None, ref["top1"])
    if not acc["passed"]:
        partial.unlink(missing_ok=True)
        return {**row, "accuracy": acc, "error": f"the exported {rung.name} fails the accuracy "
                f"gate ({acc['agreement']:.1%} top-1 agreement)"}
    os.replace(partial, package)
    flops = ref.get("flops")
    return {**row, "applied": done.get("applied"), "accuracy": acc,
            "throughput": got["throughput"], "step_time_s": got["step_time_s"],
            "latency_ms": got["latency_ms"], "peak_allocated_gib": got.get("peak_gib"),
            "model_flops": flops,
            "tflops": flops / got["step_time_s"] / 1e12 if flops else None,
            "size_mb": package.stat().st_size / 2**20}


def export_best(spec: InferLadder, rows: list[dict], package: Path, workdir: Path) -> dict:
    """Export the fastest rung that passed (the next one where its export fails, unless torch's
    own loader crashed: then no package of this torch would load); the export row, also
    appended to ``spec.out``. Each failed attempt is named in the row's ``tried``.
    ``workdir``: the ladder's folder (the held-out images and the fp32 reference logits)."""
    passed = sorted((r for r in rows if r.get("peer") is None and r.get("rung") in RUNGS
                     and not r.get("error") and not r.get("skipped")
                     and (r.get("accuracy") or {}).get("passed")),
                    key=lambda r: -(r.get("throughput") or 0))
    if not passed:
        raise FasttrainError("no rung passed its accuracy gate: nothing to export")
    tried: list[str] = []
    for source in passed:
        row = _export_row(spec, source, package, workdir)
        if not row.get("error"):
            break
        tried.append(row["error"])
        if row.pop("loader_crash", False):  # the same loader would crash on the next rung's
            left = len(passed) - len(tried)
            if left:
                tried.append(f"{left} other passing rung(s) not tried: torch's loader, not the "
                             "rung, crashed")
            break
    peer = next((r for r in rows if r.get("rung") == "peer-compile"), None)
    row = {**compare_to_peer(row, peer), "tried": tried, "env": environment(spec.device)}
    append_row(spec.out, row)
    return row

