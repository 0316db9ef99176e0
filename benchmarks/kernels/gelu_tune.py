"""What bounds fc1's bias + GELU kernels: layouts and launch settings of the forward and the
backward on one CUDA device, each timed with GELU's math (erf, as ``kernels.activations``) and
without it (the same loads and stores, the activation replaced by the identity), at the fc1
shapes of Swin-B's four stages (batch 64) and ViT-B (batch 128). If a layout without the math
runs near the copy ceiling and with it does not, the kernel is bound by its arithmetic; if both
run slowly, by how it moves memory. Each setting is one JSONL row, timed by CUDA-graph replay;
the rate is GB/s of the minimal traffic (forward: read x, write y; backward: read dy and x,
write dx; plus the bias-gradient partials where a layout writes them). The library's own ops
and ``torch``'s copy (the ceiling) are timed alongside. The kernels here are copies of the
library's (``kernels/activations.py``) with the experiment's switches (the math, the layout),
which the library does not carry.

    PYTHONPATH=src python3 benchmarks/kernels/gelu_tune.py --out $OUT/gelu-tune.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

from fasttrain.measure.env import environment
from kernels_micro import append_rows, graph_ms  # benchmarks/kernels/, the script's own folder

SHAPES = [("swin-B stage 1 fc1", 64 * 3136, 512), ("swin-B stage 2 fc1", 64 * 784, 1024),
          ("swin-B stage 3 fc1", 64 * 196, 2048), ("swin-B stage 4 fc1", 64 * 49, 4096),
          ("vit-B fc1", 128 * 197, 3072)]
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _act(z, MATH: tl.constexpr):
    """(gelu(z), gelu'(z)) with MATH, else (z, 1 + 0 * z): the same traffic, no arithmetic."""
    if MATH:
        cdf = 0.5 * (1.0 + tl.math.erf(z * _SQRT1_2))
        return z * cdf, cdf + z * tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
    else:
        return z, z * 0.0 + 1.0


@triton.jit
def _tile_at(r0, n_rows, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Columns, their mask, the tile's mask and offsets: rows r0 … r0 + BLOCK_R (below n_rows)
    of column block ``program_id(1)``."""
    rows = r0 + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    return cols, cmask, (rows[:, None] < n_rows) & cmask[None, :], rows[:, None] * D + cols[None, :]


@triton.jit
def _fwd(x_ptr, b_ptr, y_ptr, n_rows, D, MATH: tl.constexpr, BLOCK_R: tl.constexpr,
         BLOCK_D: tl.constexpr):
    cols, cmask, mask, off = _tile_at(tl.program_id(0).to(tl.int64) * BLOCK_R, n_rows, D,
                                      BLOCK_R, BLOCK_D)
    z = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    y, _ = _act(z, MATH)
    tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_persistent(dy_ptr, x_ptr, b_ptr, dx_ptr, db_ptr, n_rows, D, rows_per_prog,
                    MATH: tl.constexpr, STAGES: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, n_rows)
    cols, cmask, _, _ = _tile_at(start, end, D, BLOCK_R, BLOCK_D)
    b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    db = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for r0 in tl.range(start, end, BLOCK_R, num_stages=STAGES):
        _, _, mask, off = _tile_at(r0, end, D, BLOCK_R, BLOCK_D)
        z = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32) + b
        dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
        _, grad = _act(z, MATH)
        dz = dy * grad
        tl.store(dx_ptr + off, dz.to(dx_ptr.dtype.element_ty), mask=mask)
        db += dz
    tl.store(db_ptr + pid * D + cols, tl.sum(db, 0), mask=cmask)


@triton.jit
def _bwd_tiles(dy_ptr, x_ptr, b_ptr, dx_ptr, db_ptr, n_rows, D, MATH: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """One tile a program; its column sums go to row ``program_id(0)`` of the partials."""
    pid = tl.program_id(0)
    cols, cmask, mask, off = _tile_at(pid.to(tl.int64) * BLOCK_R, n_rows, D, BLOCK_R, BLOCK_D)
    z = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
    _, grad = _act(z, MATH)
    dz = dy * grad
    tl.store(dx_ptr + off, dz.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + pid * D + cols, tl.sum(dz, 0), mask=cmask)


def fwd_settings(d: int):
    for elems, block_d, warps in itertools.product((4096, 8192), (256, 512, 1024, 2048), (4, 8)):
        if block_d <= d and block_d <= elems:
            yield {"layout": "tile", "elems": elems, "block_d": block_d, "warps": warps}


def bwd_settings(d: int):
    for per_sm, (elems, block_d), warps, stages in itertools.product(
            (1, 2, 4), ((2048, 512), (4096, 512), (4096, 1024), (8192, 1024)), (4, 8), (1, 3)):
        if block_d <= d and (stages == 1 or (per_sm <= 2 and elems == 4096)):
            yield {"layout": "persistent", "programs_per_sm": per_sm, "elems": elems,
                   "block_d": block_d, "warps": warps, "stages": stages}
    for block_r, block_d, warps in itertools.product((16, 32, 64), (128, 256), (4, 8)):
        yield {"layout": "tiles", "block_r": block_r, "block_d": block_d, "warps": warps}


def fwd_call(s: dict, x, b, y, math: bool):
    n, d = x.shape
    block_r = s["elems"] // s["block_d"]
    grid = (triton.cdiv(n, block_r), triton.cdiv(d, s["block_d"]))
    return lambda: _fwd[grid](x, b, y, n, d, MATH=math, BLOCK_R=block_r,
                              BLOCK_D=s["block_d"], num_warps=s["warps"])


def bwd_call(s: dict, dy, x, b, dx, math: bool):
    """(the launch, bytes of partials it writes and reads back). The persistent layout's grid
    is the library's (``_grid_persistent``) at the setting's programs per SM."""
    from fasttrain.kernels import activations as act

    n, d = x.shape
    if s["layout"] == "tiles":
        block_r = s["block_r"]
        grid = (triton.cdiv(n, block_r), triton.cdiv(d, s["block_d"]))
        kernel, args, meta = _bwd_tiles, (), {}
    else:
        block_r = s["elems"] // s["block_d"]
        progs, col_blocks, per = act._grid_persistent(x.device, n, d, block_r, s["block_d"],
                                                      s["programs_per_sm"])
        grid = (progs, col_blocks)
        kernel, args, meta = _bwd_persistent, (per,), {"STAGES": s["stages"]}
    db = torch.empty(grid[0], d, device=x.device, dtype=torch.float32)

    def run():
        kernel[grid](dy, x, b, dx, db, n, d, *args, MATH=math, BLOCK_R=block_r,
                     BLOCK_D=s["block_d"], num_warps=s["warps"], **meta)
        db.sum(0)
    return run, 2 * db.numel() * 4


def main() -> int:
    from fasttrain.kernels import activations as act

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = environment("cuda")
    rows = []

    def record(row: dict, ms: float | None, moved: int) -> None:
        row = {"kind": "gelu-tune", **row, "ms": ms,
               "gb_per_s": None if ms is None else moved / ms / 1e6, "env": env}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "env"}), flush=True)

    def timed(fn) -> tuple[float | None, str | None]:
        try:
            return graph_ms(fn), None
        except Exception as err:  # noqa: BLE001 - a setting that fails is a result
            return None, str(err).splitlines()[0][:200]

    for model, n, d in SHAPES:
        x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
        b = 0.1 * torch.randn(d, device="cuda")
        dy = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
        y, dx = torch.empty_like(x), torch.empty_like(x)
        shape = {"model": model, "rows": n, "dim": d}
        ref_y = act.bias_gelu_reference(x, b)
        ms, _ = timed(lambda: y.copy_(x))
        record({**shape, "pass": "copy (ceiling)"}, ms, 4 * n * d)
        ms, _ = timed(lambda: torch.ops.fasttrain.bias_gelu_fwd(x, b, "none"))
        record({**shape, "pass": "forward", "layout": "library"}, ms, 4 * n * d)
        ms, _ = timed(lambda: torch.ops.fasttrain.bias_gelu_bwd(dy, x, b, "none"))
        record({**shape, "pass": "backward", "layout": "library"}, ms, 6 * n * d)
        ref_dx, ref_db = torch.ops.fasttrain.bias_gelu_bwd(dy, x, b, "none")
        for s, math in itertools.product(list(fwd_settings(d)), (True, False)):
            run = fwd_call(s, x, b, y, math)
            ms, err = timed(run)
            check = {}
            if math and err is None:
                run()
                check = {"max_err": (y.float() - ref_y.float()).abs().max().item()}
            record({**shape, "pass": "forward", "math": math, **s, **check,
                    **({"error": err} if err else {})}, ms, 4 * n * d)
        for s, math in itertools.product(list(bwd_settings(d)), (True, False)):
            try:
                run, extra = bwd_call(s, dy, x, b, dx, math)
                ms, err = timed(run)
            except Exception as e:  # noqa: BLE001
                ms, err, extra = None, str(e).splitlines()[0][:200], 0
            check = {}
            if math and err is None:
                run()
                check = {"max_err": (dx.float() - ref_dx.float()).abs().max().item()}
            record({**shape, "pass": "backward", "math": math, **s, **check,
                    **({"error": err} if err else {})}, ms, 6 * n * d + extra)
    append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
