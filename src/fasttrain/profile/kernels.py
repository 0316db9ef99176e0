"""Kernel view: GPU time by category, launches per step, idle fraction, and a trace file.

torch.profiler runs over a short scheduled window (wait / warm-up / active steps) inside the
real loop; the phase timer adds ``phase:…`` record_function labels and the module timer
``record_function`` ranges show up in the trace, which opens in Perfetto or TensorBoard.
"""
from __future__ import annotations

import bisect
import gzip
import os
import re
import shutil
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from ..measure.files import write_atomic
from ..run.loop import Observer
from ..techniques.base import TrainState

# Order matters: the first pattern that matches a kernel name wins.
CATEGORIES: list[tuple[str, re.Pattern]] = [
    ("communication", re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter", re.I)),
    ("memcpy", re.compile(r"memcpy|memset", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn.*(mha|sdp)", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|fused_adam|foreach|_fused_adamw|adam", re.I)),
    ("conv", re.compile(r"conv|implicit_gemm|winograd|fprop|dgrad|wgrad|nchwToNhwc|nhwcToNchw",
                        re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|cublas|nvjet|matmul|sm\d+_.*(h|s|bf)\d*gemm|wgmma"
                        r"|triton_tem_|mm_", re.I)),
    ("norm/reduction", re.compile(r"norm|reduce|softmax|triton_red_|triton_per_|sum_|mean|"
                                  r"cross_entropy|nll_loss|log_softmax", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|triton_poi_|copy|cast|fill|"
                               r"index|cat|gelu|silu|add|mul", re.I)),
]


# Kernels that only convert dtypes (an elementwise subset): Inductor's fused ``_to_copy`` (with a
# transpose: ``_to_copy_t``). Under autocast most of them cast fp32 weights to bf16 and their
# bf16 gradients back (what bf16-mixed master_weights removes). Eager casts are not counted:
# their copy kernel also makes same-dtype strided copies, which its name does not tell apart.
CASTS = re.compile(r"^triton_poi_fused__to_copy(_t)?_\d+$")
# Memsets on the GPU timeline ("Memset (Device)", "Memset (Unknown)" in a CUDA graph): mostly the
# few-byte workspace flags that cuBLAS and cuDNN zero before their kernels (what
# graph_memset_kernels turns into kernel nodes of a captured step).
MEMSETS = re.compile(r"^memset", re.I)


def categorize(name: str) -> str:
    for cat, pat in CATEGORIES:
        if pat.search(name):
            return cat
    return "other"


def _merge(spans: list[tuple[float, float]]) -> list[list[float]]:
    """Overlapping (start, end) spans joined, sorted."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _union_length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _merge(spans))


def _in_spans(spans: list[tuple[float, float]]):
    """A test ``t -> bool``: does ``t`` fall inside one of the (merged) spans?"""
    merged = _merge(spans)
    starts = [a for a, _ in merged]
    return lambda t: (i := bisect.bisect_right(starts, t) - 1) >= 0 and t < merged[i][1]


def _is_optimizer_span(name: str) -> bool:
    return name.startswith("Optimizer.step") or name == "phase:optimizer"


def _summary(kernels: list[tuple[str, float, float]], annotations: list[tuple[str, float, float]],
             active_steps: int) -> dict:
    """(name, start µs, duration µs) of each GPU kernel/copy, and of each annotation span on the
    GPU timeline → the kernel view. A compute kernel inside an optimizer span counts as optimizer
    work whatever its name: a for-loop AdamW is thousands of plain elementwise kernels."""
    n = max(active_steps, 1)
    in_optimizer = _in_spans([(a, a + d) for name, a, d in annotations if _is_optimizer_span(name)])
    by_cat: dict[str, float] = defaultdict(float)
    top: Counter = Counter()
    spans = []
    casts, cast_us, memsets = 0, 0.0, 0
    for name, start, us in kernels:
        cat = categorize(name)
        if cat == "memcpy":
            memsets += bool(MEMSETS.search(name))
        if cat == "elementwise" and CASTS.search(name):
            casts, cast_us = casts + 1, cast_us + us
        if cat not in ("memcpy", "communication") and in_optimizer(start):
            cat = "optimizer"
        by_cat[cat] += us
        top[name] += us
        spans.append((start, start + us))
    if not spans:
        return {"kernels": 0}
    window = max(b for _, b in spans) - min(a for a, _ in spans)
    busy = _union_length(spans)
    total = sum(by_cat.values())
    return {
        "kernels": len(spans), "launches_per_step": len(spans) / n,
        "gpu_ms_per_step": {k: v / 1e3 / n for k, v in
                            sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "share": {k: v / total for k, v in by_cat.items()},
        "idle_fraction": 1.0 - busy / window if window > 0 else 0.0,
        "casts": {"per_step": casts / n, "ms_per_step": cast_us / 1e3 / n,
                  "share": cast_us / total if total else 0.0},
        "memsets_per_step": memsets / n,
        "top_kernels": [(name[:120], us / 1e3 / n) for name, us in top.most_common(8)],
    }


def kernel_summary(events, active_steps: int) -> dict:
    """GPU time by category (µs → ms), launches per step, busy/idle over the window. The
    ``record_function`` ranges that the profiler mirrors onto the GPU timeline (user
    annotations: phases, modules, ``Optimizer.step``) are spans, not kernels: left out."""
    kernels, annotations = [], []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.elapsed_us() <= 0:
            continue
        span = (e.name, e.time_range.start, e.time_range.elapsed_us())
        (annotations if getattr(e, "is_user_annotation", False) else kernels).append(span)
    return _summary(kernels, annotations, active_steps)


GPU_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}  # trace categories of real GPU work


def summary_from_trace(path: str | Path, active_steps: int) -> dict:
    """The kernel view of a saved Chrome trace (``.json`` or ``.json.gz``), e.g. to re-read a
    committed trace: ``python -m fasttrain.profile.kernels TRACE --steps N``."""
    import json

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    spans = [(e.get("cat"), (e.get("name", ""), float(e["ts"]), float(e["dur"])))
             for e in events if e.get("ph") == "X" and float(e.get("dur", 0)) > 0]
    return _summary([s for cat, s in spans if cat in GPU_WORK],
                    [s for cat, s in spans if cat == "gpu_user_annotation"], active_steps)


class KernelProfiler(Observer):
    """torch.profiler over steps [start, start + active); writes a gzipped Chrome trace."""

    name = "kernels"
    labels = True

    def __init__(self, start: int, active: int, trace_dir: Path | None):
        self.start, self.active, self.trace_dir = start, active, trace_dir
        self.prof = None
        self.cuda = False
        self.trace: dict = {}

    def attach(self, state: TrainState) -> None:
        self.cuda = state.cuda
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        wait = max(self.start - 1, 0)
        self.prof = profile(activities=acts, record_shapes=False, with_stack=False,
                            schedule=schedule(wait=wait, warmup=self.start - wait,
                                              active=self.active, repeat=1),
                            on_trace_ready=self._ready)
        self.prof.__enter__()

    def _ready(self, prof) -> None:
        from ..distributed.env import current

        if self.trace_dir is None or not current().main:  # one trace per job: rank 0's
            return
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        raw = self.trace_dir / f"trace-{os.getpid()}.json"
        prof.export_chrome_trace(str(raw))
        gz = raw.with_name("trace.pt.trace.json.gz")

        def compress(tmp: Path) -> None:
            with open(raw, "rb") as src, gzip.open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)

        try:
            write_atomic(gz, compress)  # a full disk leaves no half trace behind
        finally:
            raw.unlink(missing_ok=True)
        self.trace = {"path": str(gz), "mb": gz.stat().st_size / 1e6}

    def end(self, step: int) -> None:
        if self.prof is None:
            return
        if self.cuda and step in (self.start - 1, self.start + self.active - 1):
            # The host runs ahead of the GPU (graph replays queue up): unsynchronised, the
            # kernels of the step before the window ran inside it, and ms a step read 4/3 high
            # over three steps (profile-vit-base-20261126-010525: 40.7 ms of kernels in a
            # 30.6 ms step).
            torch.cuda.synchronize()
        self.prof.step()

    def report(self) -> dict:
        if self.prof is None:
            return {}
        self.prof.__exit__(None, None, None)
        out = {"window_steps": self.active, "trace": self.trace}
        if self.cuda:
            out.update(kernel_summary(self.prof.events(), self.active))
        else:
            out["note"] = "no GPU kernels on CPU; phases and memory only"
        return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m fasttrain.profile.kernels",
                                 description="the kernel view of a saved trace")
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, required=True, help="steps in the profiled window")
    args = ap.parse_args(argv)
    print(json.dumps(summary_from_trace(args.trace, args.steps), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
