"""Launch settings of fasttrain's memory-bound kernels, through the library's own ops, on one
CUDA device: bias + GELU (``kernels.activations.LAUNCH``), the residual add + LayerNorm /
RMSNorm (``kernels.norms.LAUNCH``) and GroupNorm + SiLU (``kernels.group_norm.LAUNCH``), each at
the shapes of the workloads that use it, forward + backward (SD's frozen VAE: forward only),
timed by CUDA-graph replay for the default settings and every alternative listed below — above
all software-pipelined loads (``stages``) in the loops of the persistent kernels. One JSONL row
a setting; GB/s of the minimal traffic.

    PYTHONPATH=src python3 benchmarks/kernels/launch_tune.py --out $OUT/launch-tune.jsonl [--only gelu,gelu-fwd,norms,groupnorm]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from fasttrain.measure.env import environment
from gelu_tune import SHAPES as FC1_SHAPES  # benchmarks/kernels/, the script's own folder
from kernels_micro import append_rows, graph_ms, norm_inputs


def _grid(**axes) -> list[dict]:
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


# bias + GELU before gelu_tune.py (4,096-element tiles up to 1,024 wide, 8 warps, 4 persistent
# backward programs per SM, no pipelining), and neighbours of the settings it chose
GELU = [{"fwd_block_d": 1024, "fwd_warps": 8, "bwd_block_d": 1024, "bwd_warps": 8,
         "programs_per_sm": 4, "stages": 1}] + _grid(stages=[2, 3, 4], programs_per_sm=[2, 3])
# the forward persistent as well: programs walking row tiles with their loads pipelined
GELU_FWD = (_grid(fwd_programs_per_sm=[2, 4, 8], fwd_stages=[2, 3, 4])
            + _grid(fwd_programs_per_sm=[2, 4], fwd_stages=[3], fwd_warps=[8],
                    fwd_elements=[4096, 8192])
            + _grid(fwd_programs_per_sm=[4], fwd_stages=[3], fwd_block_d=[512, 1024]))
NORMS = _grid(bwd_stages=[2, 3], bwd_elements=[4096, 8192], bwd_warps=[4, 8],
              programs_per_sm=[1, 2])
GROUPNORM = _grid(sum_stages=[1, 2, 3], sum_warps=[4, 8], programs_per_sm=[2, 4],
                  sum_rows=[32, 64])


def gelu_cases():
    from fasttrain.kernels import activations as act

    for model, n, d in FC1_SHAPES:
        x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = (0.1 * torch.randn(d, device="cuda")).requires_grad_()
        dy = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)

        def step(x=x, b=b, dy=dy):
            torch.autograd.grad(act.bias_gelu(x, b), (x, b), dy)
        # fwd: read x, write y; bwd: read dy, x, write dx (2 bytes each)
        yield {"model": model, "rows": n, "dim": d}, step, 10 * n * d


def norm_cases():
    from fasttrain.kernels import norms

    for kernel, model, n, d in [("layer_norm", "swin-B stage 1", 64 * 56 * 56, 128),
                                ("layer_norm", "swin-B stage 3", 64 * 14 * 14, 512),
                                ("layer_norm", "vit-B", 128 * 197, 768),
                                ("rms_norm", "llama-1B", 8192, 2048)]:
        (x, r, w, b), grads = norm_inputs(n, d)
        fn = getattr(norms, kernel)
        extra = () if kernel == "rms_norm" else (b,)

        def step(fn=fn, x=x, r=r, w=w, extra=extra, grads=grads):
            outs = fn(x, w, *extra, 1e-5, residual=r, out_dtype=torch.bfloat16)
            torch.autograd.grad(outs, (x, r, w, *extra), grads)
        # as kernels_micro's norm rows: 26 bytes an element
        yield {"model": model, "kernel": kernel, "rows": n, "dim": d}, step, 26 * n * d


def groupnorm_cases():
    from fasttrain.kernels.group_norm import group_norm

    for model, shape, grad in [("vae 512 px", (8, 128, 512, 512), False),
                               ("vae 256 px", (8, 256, 256, 256), False),
                               ("vae 128 px", (8, 512, 128, 128), False),
                               ("unet 64", (8, 320, 64, 64), True),
                               ("unet 32", (8, 640, 32, 32), True),
                               ("unet 16", (8, 1280, 16, 16), True)]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).contiguous(
            memory_format=torch.channels_last).requires_grad_(grad)
        w = torch.randn(shape[1], device="cuda").requires_grad_(grad)
        b = torch.randn(shape[1], device="cuda").requires_grad_(grad)
        cot = torch.randn_like(x)

        def step(x=x, w=w, b=b, cot=cot, grad=grad):
            if not grad:
                with torch.no_grad():
                    group_norm(x, w, b, 32, 1e-6, True)
                return
            torch.autograd.grad(group_norm(x, w, b, 32, 1e-6, True), (x, w, b), cot)
        yield ({"model": model, "shape": list(shape), "backward": grad}, step,
               (5 if grad else 2) * x.numel() * 2)


GROUPS = {"gelu": ("activations", gelu_cases, GELU),
          "gelu-fwd": ("activations", gelu_cases, GELU_FWD), "norms": ("norms", norm_cases, NORMS),
          "groupnorm": ("group_norm", groupnorm_cases, GROUPNORM)}


def main() -> int:
    import importlib

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=",".join(GROUPS))
    args = ap.parse_args()
    env = environment("cuda")
    rows = []
    for group in args.only.split(","):
        name, cases, settings = GROUPS[group]
        module = importlib.import_module(f"fasttrain.kernels.{name}")
        default = dict(module.LAUNCH)
        for shape, step, moved in cases():
            for setting in [{}] + settings:
                module.LAUNCH.update(default, **setting)
                try:
                    ms, err = graph_ms(step), None
                except Exception as e:  # noqa: BLE001 - a setting that fails is a result
                    ms, err = None, str(e).splitlines()[0][:200]
                row = {"kind": "launch-tune", "module": name, **shape,
                       "setting": setting or "default", "launch": dict(module.LAUNCH), "ms": ms,
                       "gb_per_s": None if ms is None else moved / ms / 1e6,
                       **({"error": err} if err else {})}
                print(json.dumps(row), flush=True)
                rows.append({**row, "env": env})
        module.LAUNCH.update(default)
    append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
