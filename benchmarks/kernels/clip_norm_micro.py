"""The one-launch AdamW's clip norm (``FlatAdamW._grad_norm``) against PyTorch's multi-tensor
norm (``torch._foreach_norm`` per dtype, then the norm of the norms, as ``clip_grad_norm_``),
over a workload's trainable weights as the master-weights recipe leaves them: bf16 gradients
for the linear and convolution weights and biases, fp32 for the rest. Median of
``triton.testing.do_bench`` (launched from Python) and of CUDA-graph replay, at several
``NORM_LAUNCH`` block sizes; one JSON row per variant.

    python3 benchmarks/kernels/clip_norm_micro.py --workload sd --out rows.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch


def main() -> int:
    from triton.testing import do_bench

    from fasttrain.measure.env import environment
    from fasttrain.kernels import adamw
    from fasttrain.optim.adamw import FlatAdamW
    from fasttrain.techniques.optimizer import matmul_weights
    from fasttrain.workloads import load_workload

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="sd")
    ap.add_argument("--blocks", default="1024x1,1024x4,1024x8,2048x4,8192x1",
                    help="NORM_LAUNCH variants, BLOCKxCHUNKS (chunks a program), comma-separated")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    wl = load_workload(args.workload, "base")
    with torch.device("meta"):
        model = wl.trainable(wl.build_model())
        half = {id(p) for p in matmul_weights(model)}
        specs = [(p.shape, id(p) in half) for p in model.parameters() if p.requires_grad]
    torch.manual_seed(0)
    weights = [torch.randn(s, device="cuda", dtype=torch.bfloat16 if h else torch.float32)
               .requires_grad_() for s, h in specs]
    for w in weights:
        w.grad = torch.randn_like(w) * 1e-3
    grads = [w.grad for w in weights]
    n = sum(g.numel() for g in grads)
    moved = sum(g.numel() * g.element_size() for g in grads)

    def torch_norm():
        by: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by.setdefault(g.dtype, []).append(g)
        norms = [x for group in by.values()
                 for x in torch._foreach_norm(group, 2.0, dtype=torch.float32)]
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def graphed(fn):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return do_bench(graph.replay, warmup=5, rep=50, return_mode="median")

    env = environment()
    rows = []

    def row(variant, fn):
        want = torch_norm()
        got = fn()
        rows.append({"kind": "clip-norm-micro", "workload": args.workload, "variant": variant,
                     "tensors": len(grads), "params_m": round(n / 1e6, 1),
                     "ms_launched": do_bench(fn, warmup=5, rep=50, return_mode="median"),
                     "ms": graphed(fn), "gb_per_s": None,
                     "rel_diff": abs(got.item() - want.item()) / want.item(), "env": env})
        rows[-1]["gb_per_s"] = moved / rows[-1]["ms"] / 1e6
        print(f"{variant:40s} {rows[-1]['ms']:.3f} ms (launched {rows[-1]['ms_launched']:.3f})"
              f" {rows[-1]['gb_per_s']:.0f} GB/s rel diff {rows[-1]['rel_diff']:.1e}")

    row("torch multi-tensor norm", torch_norm)
    default = dict(adamw.NORM_LAUNCH)
    try:
        for variant in args.blocks.split(","):
            block, chunks = (int(v) for v in variant.split("x"))
            adamw.NORM_LAUNCH.update(block=block, chunks=chunks, warps=4 if block <= 2048 else 8)
            masters = [w.detach().float() if w.dtype == torch.bfloat16 else None
                       for w in weights]
            opt = FlatAdamW(weights, lr=1e-4, max_grad_norm=1.0, masters=masters)
            present = opt._grads()
            table, inc = opt._upload(present), opt._increments(present)
            row(f"one launch, {chunks} x {block} a program, {adamw.NORM_LAUNCH['warps']} warps",
                lambda: opt._grad_norm(table, inc))
            opt = masters = None  # the state's memory back before the next block size
            torch.cuda.empty_cache()
    finally:
        adamw.NORM_LAUNCH.update(default)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
