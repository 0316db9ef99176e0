"""Launch settings of the window-attention kernel on one CUDA device: forward, and forward +
backward, time of Swin-B's four stages (batch 64, 7×7 windows, shifted blocks' masks) for each
setting of ``kernels.window_attention.LAUNCH`` tried, one JSONL row each, timed by CUDA-graph
replay (the kernels' GPU time, not Python's launch cost: the fast preset runs under graphs).
``--module`` times another copy of the kernel module the same way (e.g. an earlier commit's, to
compare). Also compiles the op with Inductor in-process and records its traceback if that
fails, and the registers and spills of each compiled kernel.

    PYTHONPATH=src python3 benchmarks/kernels/window_tune.py --out $OUT/window-tune.jsonl
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import traceback

import torch

from fasttrain.measure.env import environment
from kernels_micro import append_rows, graph_ms  # benchmarks/kernels/, the script's own folder

STAGES = [(1, 4096, 4, 128, 56), (2, 1024, 8, 256, 28), (3, 256, 16, 512, 14),
          (4, 64, 32, 1024, 7)]  # stage, windows, heads, channels, resolution (batch 64)


def compiled_check(wa) -> str | None:
    """None if Inductor compiles the op (fwd + bwd), else the traceback."""
    import torch._inductor.config as cfg

    from fasttrain.layers.windows import shift_mask

    cfg.compile_threads = 1  # the compile error in this process, not in a worker's
    qkv = torch.randn(64, 49, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(4, 49, 49, device="cuda", requires_grad=True)
    mask = shift_mask(28, 7, 3).cuda()
    try:
        out = torch.compile(lambda q, b: wa.window_attention(q, b, mask, 4) * 2)(qkv, bias)
        out.float().sum().backward()
        return None
    except Exception:  # noqa: BLE001 - the point is to record it
        return traceback.format_exc()


def kernel_resources(wa) -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of the module's kernels."""
    found = []
    for name in ("_fwd_kernel", "_bwd_kernel"):
        caches = getattr(getattr(wa, name), "device_caches", {})
        for cache in caches.values():
            for key, kernel in (cache[0] if isinstance(cache, tuple) else cache).items():
                try:
                    found.append({"kernel": name, "key": str(key)[-160:],
                                  "registers": kernel.n_regs, "spills": kernel.n_spills,
                                  "shared": kernel.metadata.shared,
                                  "warps": kernel.metadata.num_warps})
                except AttributeError:
                    continue
    return found


def main() -> int:
    from fasttrain.layers.windows import shift_mask

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--module", default="fasttrain.kernels.window_attention",
                    help="the kernel module to time (importable)")
    ap.add_argument("--label", default="current")
    ap.add_argument("--passes", default="forward,backward",
                    help="which settings to sweep: forward, backward (forward + backward runs)")
    args = ap.parse_args()
    passes = set(args.passes.split(","))
    wa = importlib.import_module(args.module)
    env = environment("cuda")
    base = {"module": args.module, "label": args.label, "env": env}
    rows = [{"kind": "window-compile-check", "traceback": compiled_check(wa), **base}]
    print("inductor:", rows[0]["traceback"] or "compiled", flush=True)
    # one window a program (fwd_programs_per_sm 0), or persistent with pipelined loads
    fwd_settings = [dict(fwd_warps=w) for w in (2, 4, 8)] + [
        dict(fwd_warps=w, fwd_programs_per_sm=p, fwd_stages=s)
        for w, p, s in itertools.product((4,), (2, 4, 8), (2, 3))] + [
        dict(fwd_warps=8, fwd_programs_per_sm=p, fwd_stages=3) for p in (2, 4)]
    fwd_settings = fwd_settings if "forward" in passes else []
    bwd_settings = [dict(bwd_warps=w, stages=s, programs_per_sm=p)
                    for w, s, p in itertools.product((4, 8), (1, 3), (1, 2, 4))]
    bwd_settings = bwd_settings if "backward" in passes else []
    default = dict(wa.LAUNCH)

    def record(row: dict) -> None:
        rows.append({**row, **base})
        print(json.dumps(row), flush=True)

    for stage, windows, heads, dim, res in STAGES:
        qkv = torch.randn(windows, 49, 3 * dim, device="cuda", dtype=torch.bfloat16,
                          requires_grad=True)
        bias = torch.randn(heads, 49, 49, device="cuda", requires_grad=True)
        mask = shift_mask(res, 7, 3).cuda() if res > 7 else None
        dy = torch.randn(windows, 49, dim, device="cuda", dtype=torch.bfloat16)

        def forward():
            with torch.no_grad():
                wa.window_attention(qkv, bias, mask, heads)

        def both():
            torch.autograd.grad(wa.window_attention(qkv, bias, mask, heads), (qkv, bias), dy)

        for setting in fwd_settings:
            wa.LAUNCH.update(default, **setting)
            try:
                ms = graph_ms(forward)
            except Exception as err:  # noqa: BLE001 - a setting that fails is a result
                ms, setting = None, {**setting, "error": str(err).splitlines()[0][:200]}
            record({"kind": "window-tune", "pass": "forward", "stage": stage, **setting,
                    "ms": ms})
        for setting in bwd_settings:
            wa.LAUNCH.update(default, **setting)
            try:
                ms = graph_ms(both)
            except Exception as err:  # noqa: BLE001 - a setting that fails is a result
                ms, setting = None, {**setting, "error": str(err).splitlines()[0][:200]}
            record({"kind": "window-tune", "pass": "forward+backward", "stage": stage,
                    **setting, "ms": ms})
    wa.LAUNCH.update(default)
    rows += [{"kind": "window-kernel-resources", **r, **base} for r in kernel_resources(wa)]
    append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
