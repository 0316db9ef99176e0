"""fc1 + bias + GELU (forward) and fc2's input gradient × GELU' (backward) as one Triton GEMM
each with the GELU in its epilogue (``benchmarks/gemm_gelu_kernels.py``), against what the fast
presets run today: a cuBLAS GEMM plus fasttrain's bias + GELU kernel each way. One JSONL row per
(shape, direction, variant, tile config): median ms of a CUDA-graph replay, TFLOP/s of the GEMM,
and the max error against the plain-PyTorch composition; then the whole MLP forward + backward
(``gelu_mlp`` against ``Mlp`` with ``kernels=gelu``), eager and under torch.compile. Variants:
``cublas`` (the GEMM alone), ``cublas+kernel`` (today's path), ``triton`` (gemm_gelu_kernels.py's
pointer-load kernel over a sweep of tiles), ``tma`` (a persistent variant of this script with
TMA descriptors, to see what that layout would add).

    PYTHONPATH=src python3 benchmarks/gemm_gelu_micro.py --out $OUT/gemm-gelu-micro.jsonl
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from fasttrain.env import environment
from fasttrain.kernels.activations import _gelu_and_grad, bias_gelu
import gemm_gelu_kernels as gg  # benchmarks/, the script's own folder
from kernels_micro import append_rows, graph_ms

SHAPES = [("vit-b", 128 * 197, 768, 3072), ("swin-b s3", 64 * 196, 512, 2048)]
TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3),
         (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (64, 256, 64, 4, 4), (128, 128, 128, 8, 3)]
TMA_TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
             (128, 256, 64, 8, 4)]


@triton.jit
def _tma_kernel(x_ptr, w_ptr, b_ptr, aux_ptr, out_ptr, parts_ptr, M, N, K: tl.constexpr,
                BWD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GROUP_M: tl.constexpr, STAGES: tl.constexpr, SMS: tl.constexpr):
    """Persistent: forward a = x wᵀ + b → aux, gelu(a) → out (w (N, K)); backward
    (x w) · gelu'(aux) → out and its column sums (w (K, N))."""
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BM, BK])
    if BWD:
        w_desc = tl.make_tensor_descriptor(w_ptr, [K, N], [N, 1], [BK, BN])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BN, BK])
    aux_desc = tl.make_tensor_descriptor(aux_ptr, [M, N], [N, 1], [BM, BN])
    out_desc = tl.make_tensor_descriptor(out_ptr, [M, N], [N, 1], [BM, BN])
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, SMS, flatten=True):
        first_m = (tile // per_group) * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % size_m
        pid_n = (tile % per_group) // size_m
        acc = tl.zeros((BM, BN), tl.float32)
        for k in tl.range(0, K // BK, num_stages=STAGES):
            a = x_desc.load([pid_m * BM, k * BK])
            if BWD:
                b = w_desc.load([k * BK, pid_n * BN])
            else:
                b = tl.trans(w_desc.load([pid_n * BN, k * BK]))
            acc = tl.dot(a, b, acc)
        cols = pid_n * BN + tl.arange(0, BN)
        if BWD:
            pre = aux_desc.load([pid_m * BM, pid_n * BN]).to(tl.float32)
            _, slope = _gelu_and_grad(pre, False)
            d = acc * slope  # rows past M: acc is 0 (TMA pads with zeros)
            out_desc.store([pid_m * BM, pid_n * BN], d.to(out_ptr.dtype.element_ty))
            tl.store(parts_ptr + pid_m * N + cols, tl.sum(d, 0), mask=cols < N)
        else:
            z = acc + tl.load(b_ptr + cols, mask=cols < N, other=0.0)[None, :]
            aux_desc.store([pid_m * BM, pid_n * BN], z.to(aux_ptr.dtype.element_ty))
            g, _ = _gelu_and_grad(z, False)
            out_desc.store([pid_m * BM, pid_n * BN], g.to(out_ptr.dtype.element_ty))


def _tma(way, x, w, b, aux, out, parts, tile, sms):
    bm, bn, bk, warps, stages = tile
    M, K = x.shape
    N = aux.shape[1]
    grid = (min(sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    _tma_kernel[grid](x, w, b, aux, out, parts, M, N, K, BWD=way == "bwd", BM=bm, BN=bn, BK=bk,
                      GROUP_M=8, STAGES=stages, SMS=sms, num_warps=warps)


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def directions(name, M, D, H, env, out):
    """Forward and backward GEMM + GELU alone, every variant and tile."""
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(M, D, device=dev, dtype=bf)
    w1 = torch.randn(H, D, device=dev, dtype=bf) / D ** 0.5
    b1 = torch.randn(H, device=dev) * 0.1
    w2 = torch.randn(D, H, device=dev, dtype=bf) / H ** 0.5
    dy = torch.randn(M, D, device=dev, dtype=bf)
    flops = 2 * M * D * H
    pre = (x.float() @ w1.float().t() + b1)
    ref_g = torch.nn.functional.gelu(pre).to(bf)
    a = pre.to(bf)
    slope = torch.ops.aten.gelu_backward(torch.ones_like(pre), a.float())
    ref_da = ((dy.float() @ w2.float()) * slope).to(bf)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device=dev,
                                                                 dtype=torch.int8))
    rows = []

    def row(way, variant, tile, fn, check):
        try:
            got = fn()
            torch.cuda.synchronize()
            err = _err(got, check)
            ms, error = graph_ms(fn), None
        except Exception as e:  # noqa: BLE001 - a failing variant is a row
            ms, err, error = None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        r = {"kind": "gemm-gelu-micro", "shape": name, "M": M, "D": D, "H": H, "way": way,
             "variant": variant, "tile": tile, "ms": ms,
             "tflops": flops / ms / 1e9 if ms else None, "max_rel_err": err, "error": error,
             "env": env}
        print(f"{name} {way} {variant:14s} {str(tile):26s} "
              + (f"{ms:.4f} ms {r['tflops']:.0f} TFLOP/s err {err:.1e}" if ms else str(error)),
              flush=True)
        rows.append(r)

    row("fwd", "cublas", None, lambda: x @ w1.t(), (pre - b1).to(bf))
    row("fwd", "cublas+kernel", None, lambda: bias_gelu(x @ w1.t(), b1), ref_g)
    row("bwd", "cublas", None, lambda: dy @ w2, (dy.float() @ w2.float()).to(bf))
    row("bwd", "cublas+kernel", None,
        lambda: torch.ops.fasttrain.bias_gelu_bwd(dy @ w2, a, torch.zeros_like(b1), "none")[0],
        ref_da)
    for tile in TILES:
        cfg = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), tile),
                   GROUP_M=8)
        gg.LAUNCH["fwd"], gg.LAUNCH["bwd"] = dict(cfg), dict(cfg)
        row("fwd", "triton", tile, lambda: gg.gemm_gelu_fwd(x, w1, b1)[0], ref_g)
        row("bwd", "triton", tile, lambda: gg.gemm_gelu_bwd(dy, w2, a)[0], ref_da)
    aux, out_ = torch.empty(M, H, device=dev, dtype=bf), torch.empty(M, H, device=dev, dtype=bf)
    parts = torch.empty(triton.cdiv(M, 64), H, device=dev)
    for tile in TMA_TILES:
        row("fwd", "tma", tile, lambda: (_tma("fwd", x, w1, b1, aux, out_, parts, tile, sms),
                                          out_)[1], ref_g)
        row("bwd", "tma", tile, lambda: (_tma("bwd", dy, w2, b1, a, out_, parts, tile, sms),
                                          out_)[1], ref_da)
    append_rows(out, rows)
    return rows


def whole_mlp(name, M, D, H, env, out, best):
    """The MLP forward + backward, today's path against ``gelu_mlp`` with the best tiles."""
    from fasttrain.layers.mlp import Mlp

    rows = []
    for way, tile in best.items():
        gg.LAUNCH[way] = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
                                  tile), GROUP_M=8)
    mlp = Mlp(D, H).cuda().to(torch.bfloat16)
    mlp.fc1.bias.data = mlp.fc1.bias.data.float()
    mlp.use_fused(True)
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)

    def today():
        return mlp(x, fc2_bias=False)

    def fused():
        return gg.gelu_mlp(x, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight)

    for variant, fn in (("cublas+kernel", today), ("gemm-gelu", fused)):
        for compiled in (False, True):
            torch._dynamo.reset()
            f = torch.compile(fn) if compiled else fn

            def step():
                for t in (x, *mlp.parameters()):
                    t.grad = None
                f().backward(dy)
            try:
                step()
                ms, error = graph_ms(step), None
            except Exception as e:  # noqa: BLE001
                ms, error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            r = {"kind": "gemm-gelu-mlp", "shape": name, "M": M, "D": D, "H": H,
                 "variant": variant, "compiled": compiled, "tiles": best, "ms": ms,
                 "tflops": 6 * 2 * M * D * H / ms / 1e9 if ms else None, "error": error,
                 "env": env}
            print(f"{name} MLP fwd+bwd {variant:14s} compiled={compiled}: "
                  + (f"{ms:.4f} ms" if ms else str(error)), flush=True)
            rows.append(r)
    append_rows(out, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = environment("cuda")
    for name, M, D, H in SHAPES:
        rows = directions(name, M, D, H, env, args.out)
        best = {}
        for way in ("fwd", "bwd"):
            cands = [r for r in rows if r["way"] == way and r["variant"] == "triton" and r["ms"]]
            if cands:
                best[way] = min(cands, key=lambda r: r["ms"])["tile"]
        whole_mlp(name, M, D, H, env, args.out, best)


if __name__ == "__main__":
    main()
