"""How cheap exact GELU's math can be in the bias + GELU kernels: the forward and the backward of
``kernels.activations`` timed on one CUDA device at ViT-B's fc1 (25,216 × 3,072, batch 128) and
Swin-B stage 1's fc1 (200,704 × 512, batch 64) with several formulations of the normal CDF Φ(z)
and of GELU's derivative, everything else (loads, stores, tiles, persistent grid, software-
pipelined loads) the library's. ``benchmarks/gelu_tune.py`` found these kernels bound by GELU's
arithmetic (forward 2.7 TB/s with it, 3.8 without, the same loads and stores). Compiled for
sm_90 (``--sass``), the forward spends 8.75 instructions an element on its loads and stores and
32 more on libdevice's erf (13 of them moves that pick one of ``erff``'s two polynomials'
coefficients, which its branch selects), the backward 17 and 39. Formulations, each a
``@triton.jit`` helper returning (gelu(z), gelu'(z)) in fp32, u = z/√2:

    identity       no math, (z, 1): the same traffic, the kernels' bandwidth ceiling
    libdevice      today's: Φ = 0.5·(1 + erf(u)) with libdevice's erff, the pdf by tl.exp
    erfc-nr        Numerical Recipes' erfcc: e = 0.5·erfc(|u|) = t·2^(-z²·log2(e)/2 + Q(t)),
                   t = 1/(1 + |u|/2), Q a 10-coefficient polynomial (fractional error < 1.2e-7),
                   Φ = 1 - e (z ≥ 0) or e; one MUFU.RCP and one MUFU.EX2, the pdf a second EX2
    minimax        e = t·P(t)·E with E = exp(-z²/2), the pdf's own exponential (one EX2 for
                   both), t = 1/(1 + |z|/2), P an 11-coefficient relative minimax fit of
                   erfcx(|u|)/(2t); for z < 0, e's exponent corrected for the rounding of z² and
                   of its product with log2(e)/2 (which would cost Φ up to ~100 ulp at z = -11)
    minimax-plain  the same without that correction (5 instructions fewer)

and, as ceilings, torch's copy of the forward's bytes and an add of the backward's (read two,
write one). Each (shape, pass, formulation, launch setting) is one JSONL row: ms of a CUDA-graph
replay (median), GB/s of the minimal traffic (forward: read x, write y; backward: read dy and x,
write dx; the backward's bias-gradient partials and their sum are timed, not counted),
registers, the output's max error against float64 values rounded to bf16 and the share of
outputs that differ from that rounding (the library's ops get these too), and the formulation's
accuracy (below), measured on the device and from ``--check`` (CPU). The
launch settings are the library's ``LAUNCH`` and two variants that the cheaper math's fewer
registers allow (more programs an SM, smaller tiles).

``--check`` (CPU only: Triton's interpreter, ~20 s) evaluates each helper at 2e5 float32 points
of z in [-12, 12] plus extremes (±1e4, ±60, 0, small and denormal values) against float64
values from erfc: the max error in fp32 ulps (of max(|ref|, 2^-126)) and absolute, of gelu where
|gelu| > 1e-30 and of gelu' (whose bar is 4 ulp or 1e-7 at each point). It runs each helper
with the interpreter's correctly rounded exp2, division and erf, and with a model of the GPU's
(libdevice's erff coefficient for coefficient; MUFU.EX2 ±2 ulp, MUFU.RCP ±1 ulp, div.full
±2 ulp, the bounds CUDA's programming guide gives exp2f, 1/x and x/y without -prec-div; tl.exp
as EX2 of a rounded product; every sign combination, the worst kept: a bound, not what the
hardware does). It also runs
``tests.helpers.check_exact_gelu`` (the library's bar) on forward and backward kernels with each
helper. ``--sass`` (CPU only: Triton's bundled ptxas and cuobjdump, ~20 s) compiles the kernels
for sm_90 and counts SASS instructions an element, and registers at the library's settings.
``--fit`` recomputes minimax's coefficients (mpmath, ~30 s).

    PYTHONPATH=src:benchmarks python3 benchmarks/erf_tune.py --out $OUT/erf-tune.jsonl
    PYTHONPATH=src:benchmarks python3 benchmarks/erf_tune.py --check
    PYTHONPATH=src:benchmarks python3 benchmarks/erf_tune.py --sass
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

if "--check" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"  # fixed when triton is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fasttrain.env import environment  # noqa: E402
from fasttrain.kernels import activations as act  # noqa: E402
from fasttrain.kernels._triton import INTERPRETED  # noqa: E402
from fasttrain.kernels.activations import _columns, _gelu_and_grad, _rows  # noqa: E402
from kernels_micro import append_rows, graph_ms  # noqa: E402  (benchmarks/, this script's folder)

SHAPES = [("vit-B fc1", 128 * 197, 3072), ("swin-B stage 1 fc1", 64 * 3136, 512)]
DEVICE = "cuda"  # of the benchmark
FORMS = {"identity": 0, "libdevice": 1, "erfc-nr": 2, "minimax": 3, "minimax-plain": 4}

_COMPILED = tl.constexpr(not INTERPRETED)  # the interpreter has no inline PTX
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1/sqrt(2*pi)
_NEG_HALF_LOG2E = tl.constexpr(-0.7213475204444817)  # exp(-z²/2) = 2^(z² · this)
_LN2 = tl.constexpr(0.6931471805599453)

# Numerical Recipes' erfcc (2nd ed., 6.2): erfc(x) ≈ t·exp(-x² + P(t)), t = 1/(1 + x/2), x ≥ 0,
# fractional error < 1.2e-7. Here x = |z|/√2, so t = 1/(1 + |z|/(2√2)); the coefficients are
# P's times log2(e) (for exp2), and the constant also takes log2(1/2), so the exp2 gives
# 0.5·erfc(x) / t.
_NR = [c * 1.4426950408889634 for c in (
    -1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
    1.48851587, -0.82215223, 0.17087277)]
_NR[0] -= 1.0
_NR_K = tl.constexpr(0.3535533905932738)  # 1/(2√2)
_N0, _N1, _N2, _N3, _N4, _N5, _N6, _N7, _N8, _N9 = (tl.constexpr(c) for c in _NR)

# minimax: 0.5·erfc(|z|/√2) = t·P(t)·E, t = 1/(1 + |z|/2), E = 2^(z²·fp32(-log2(e)/2)) (so the
# fp32 constant's own rounding is inside P). P: relative minimax fit in float64 (Lawson's
# iteratively reweighted least squares in a Chebyshev basis, 4,000 points of t for |z| ≤ 13.5,
# the target from mpmath at 40 digits): max relative error 2.2e-8 (0.2-0.4 ulp) before the
# coefficients' and the evaluation's fp32 rounding. Beyond |z| = 13.5, E is 0 (ex2.ftz). The
# scale 1/2 keeps small an error of t's amplification into t·P(t) (1.6x at most, 3.2x with
# 1/4), and the coefficients small enough for Horner's rule in fp32 (fits with larger scales
# need 12+ coefficients that alternate in sign up to ±12, and lose more there than they gain).
_MM_K = tl.constexpr(0.5)
_MM = (0.19947932660579681, 0.19918705523014069, 0.15347309410572052, 0.021620867773890495,
       0.05947725102305412, -0.4237932860851288, 0.3806008994579315, 0.05899956822395325,
       -0.2902342975139618, 0.17867964506149292, -0.0374901220202446)
_M0, _M1, _M2, _M3, _M4, _M5, _M6, _M7, _M8, _M9, _M10 = (tl.constexpr(c) for c in _MM)


# ----------------------------------------------------------------------------- formulations

@triton.jit
def _rcp(d):
    """1/d for 1 ≤ d < 2^126: one MUFU.RCP compiled (rcp.approx.ftz.f32, within 1 ulp; Triton's
    division would add range checks, libdevice's fast division a canonicalizing add); a
    division interpreted."""
    if _COMPILED:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.fdiv(1.0, d, approx=True)


@triton.jit
def _erfc_nr(z):
    """Φ(z) = 1 - e (z ≥ 0) or e (z < 0), e = 0.5·erfc(|z|/√2) by Numerical Recipes' erfcc."""
    t = _rcp(tl.fma(tl.abs(z), _NR_K, 1.0))
    p = tl.fma(t, _N9, _N8)
    p = tl.fma(p, t, _N7)
    p = tl.fma(p, t, _N6)
    p = tl.fma(p, t, _N5)
    p = tl.fma(p, t, _N4)
    p = tl.fma(p, t, _N3)
    p = tl.fma(p, t, _N2)
    p = tl.fma(p, t, _N1)
    p = tl.fma(p, t, _N0)
    q = z * z
    h = tl.exp2(tl.fma(q, _NEG_HALF_LOG2E, p))  # e / t
    cdf = tl.where(z >= 0, tl.fma(-t, h, 1.0), t * h)
    pdf = tl.exp2(q * _NEG_HALF_LOG2E)  # * 1/sqrt(2π) below
    return z * cdf, tl.fma(z * _INV_SQRT_2PI, pdf, cdf)


@triton.jit
def _minimax(z, ACC: tl.constexpr):
    """Φ(z) = 1 - e (z ≥ 0) or e (z < 0) with e = t·P(t)·E, E = exp(-z²/2) shared with the
    pdf. ACC: for z < 0, where Φ's relative error is e's, e's exponent z²·c (c =
    fp32(-log2(e)/2)) with the roundings of z² and of the product added back,
    e·2^δ ≈ e + e·ln2·δ (the error of c itself is inside P's fit). The pdf and 1 - e take E as
    it is: what that costs them is absolute, at most ~3e-8 in gelu' (at |z| ≈ 2) and well
    under an ulp of 1 - e."""
    t = _rcp(tl.fma(tl.abs(z), _MM_K, 1.0))
    p = tl.fma(t, _M10, _M9)
    p = tl.fma(p, t, _M8)
    p = tl.fma(p, t, _M7)
    p = tl.fma(p, t, _M6)
    p = tl.fma(p, t, _M5)
    p = tl.fma(p, t, _M4)
    p = tl.fma(p, t, _M3)
    p = tl.fma(p, t, _M2)
    p = tl.fma(p, t, _M1)
    p = tl.fma(p, t, _M0)
    q = z * z
    a = q * _NEG_HALF_LOG2E
    big_e = tl.exp2(a)
    tp = t * p
    e = tp * big_e
    if ACC:
        delta = tl.fma(tl.fma(z, z, -q), _NEG_HALF_LOG2E, tl.fma(q, _NEG_HALF_LOG2E, -a))
        e = tl.fma(e * _LN2, delta, e)
    cdf = tl.where(z >= 0, tl.fma(-tp, big_e, 1.0), e)
    return z * cdf, tl.fma(z * _INV_SQRT_2PI, big_e, cdf)


@triton.jit
def _act(z, FORM: tl.constexpr):
    """(gelu(z), gelu'(z)) by formulation FORM (``FORMS``); 0: (z, 1), the same traffic."""
    if FORM == 1:
        return _gelu_and_grad(z, False)  # the library's exact GELU, as it is
    elif FORM == 2:
        return _erfc_nr(z)
    elif FORM == 3:
        return _minimax(z, True)
    elif FORM == 4:
        return _minimax(z, False)
    else:
        return z, z * 0.0 + 1.0


# ----------------------------------------------------------------------------- kernels
# The library's _bias_gelu_fwd_kernel / _bias_gelu_bwd_kernel (with a bias) over its own tile
# helpers, the math switched.


@triton.jit
def _fwd_kernel(x_ptr, b_ptr, y_ptr, n_rows, D, rows_per_prog, FORM: tl.constexpr,
                STAGES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, n_rows)
    cols, cmask = _columns(D, BLOCK_D)
    b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for r0 in tl.range(start, end, BLOCK_R, num_stages=STAGES):
        off, mask = _rows(r0, end, cols, cmask, D, BLOCK_R)
        z = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32) + b
        y, _ = _act(z, FORM)
        tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(dy_ptr, x_ptr, b_ptr, dx_ptr, db_ptr, n_rows, D, rows_per_prog,
                FORM: tl.constexpr, STAGES: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, n_rows)
    cols, cmask = _columns(D, BLOCK_D)
    b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    db = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for r0 in tl.range(start, end, BLOCK_R, num_stages=STAGES):
        off, mask = _rows(r0, end, cols, cmask, D, BLOCK_R)
        z = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32) + b
        dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
        _, grad = _act(z, FORM)
        dz = dy * grad  # 0 where masked (dy = 0, grad finite)
        tl.store(dx_ptr + off, dz.to(dx_ptr.dtype.element_ty), mask=mask)
        db += dz
    tl.store(db_ptr + pid * D + cols, tl.sum(db, 0), mask=cmask)


@triton.jit
def _eval_kernel(z_ptr, y_ptr, g_ptr, n, FORM: tl.constexpr, BLOCK: tl.constexpr):
    """gelu and gelu' of fp32 z, for the accuracy check."""
    off = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = off < n
    y, g = _act(tl.load(z_ptr + off, mask=mask, other=0.0), FORM)
    tl.store(y_ptr + off, y, mask=mask)
    tl.store(g_ptr + off, g, mask=mask)


# ----------------------------------------------------------------------------- launches

def settings() -> tuple[list[dict], list[dict]]:
    """(forward, backward) launch settings: the library's ``LAUNCH`` first, then variants the
    cheaper math's fewer registers allow (sm_90, ``--sass``: the library's forward tile takes
    91 registers a thread with libdevice, ~60 with the others; its backward 162 against 96)."""
    lib = act.LAUNCH
    fwd = [{"setting": "library", "elements": lib["fwd_elements"], "block_d": lib["fwd_block_d"],
            "warps": lib["fwd_warps"], "programs_per_sm": lib["fwd_programs_per_sm"],
            "stages": lib["fwd_stages"]},
           {"setting": "8/SM", "elements": 4096, "block_d": 1024, "warps": 4,
            "programs_per_sm": 8, "stages": 3},
           {"setting": "2k tiles 8/SM", "elements": 2048, "block_d": 1024, "warps": 4,
            "programs_per_sm": 8, "stages": 3}]
    bwd = [{"setting": "library", "elements": lib["bwd_elements"], "block_d": lib["bwd_block_d"],
            "warps": lib["bwd_warps"], "programs_per_sm": lib["programs_per_sm"],
            "stages": lib["stages"]},
           {"setting": "4/SM", "elements": 4096, "block_d": 512, "warps": 4,
            "programs_per_sm": 4, "stages": 3},
           {"setting": "2k tiles 4/SM", "elements": 2048, "block_d": 512, "warps": 4,
            "programs_per_sm": 4, "stages": 3}]
    return fwd, bwd


def _geometry(s: dict, device, n: int, d: int) -> tuple[tuple[int, int], int, int, int]:
    """(grid, rows a program, BLOCK_R, BLOCK_D) as the library's ops compute them."""
    block_r, block_d = act._tile(d, s["elements"], s["block_d"])
    progs, col_blocks, per = act._grid_persistent(device, n, d, block_r, block_d,
                                                  s["programs_per_sm"])
    return (progs, col_blocks), per, block_r, block_d


def fwd_call(form: int, s: dict, x, b, y):
    """The launch; it returns Triton's compiled kernel (registers, spills)."""
    n, d = x.shape
    grid, per, block_r, block_d = _geometry(s, x.device, n, d)
    return lambda: _fwd_kernel[grid](x, b, y, n, d, per, FORM=form, STAGES=s["stages"],
                                     BLOCK_R=block_r, BLOCK_D=block_d, num_warps=s["warps"])


def bwd_call(form: int, s: dict, dy, x, b, dx):
    """The launch and the sum of its bias-gradient partials (as the library's op does); it
    returns Triton's compiled kernel."""
    n, d = x.shape
    grid, per, block_r, block_d = _geometry(s, x.device, n, d)
    partials = torch.empty(grid[0], d, device=x.device, dtype=torch.float32)

    def run():
        kernel = _bwd_kernel[grid](dy, x, b, dx, partials, n, d, per, FORM=form,
                                   STAGES=s["stages"], BLOCK_R=block_r, BLOCK_D=block_d,
                                   num_warps=s["warps"])
        partials.sum(0)
        return kernel
    return run


class _Gelu(torch.autograd.Function):
    """bias_gelu(x, bias, "none") with one formulation, through the library's LAUNCH: what
    ``tests.helpers.check_exact_gelu`` takes."""

    @staticmethod
    def forward(ctx, x, bias, form):
        d = x.shape[-1]
        x2 = x.reshape(-1, d).contiguous()
        b = torch.zeros(d, device=x.device) if bias is None else bias
        ctx.save_for_backward(x2, b)
        ctx.form, ctx.shape = form, x.shape
        y = torch.empty_like(x2)
        fwd_call(form, settings()[0][0], x2, b, y)()
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, b = ctx.saved_tensors
        dx = torch.empty_like(x2)
        bwd_call(ctx.form, settings()[1][0], dy.reshape(x2.shape).contiguous(), x2, b, dx)()
        return dx.view(ctx.shape), None, None


def _bias_gelu_with(form: int):
    def bias_gelu(x, bias, approximate="none"):
        assert approximate == "none"
        return _Gelu.apply(x, bias, form)
    return bias_gelu


# ----------------------------------------------------------------------------- accuracy

def eval_points() -> np.ndarray:
    """float32 z: 2e5 + 1 points evenly over [-12, 12], extremes, small and denormal values."""
    dense = np.linspace(-12.0, 12.0, 200_001)
    small = np.geomspace(1e-30, 1.0, 2_000)
    extremes = [1e4, 60.0, 30.0, 13.5, 13.0, 12.5, 1e-38, 2.0 ** -126, 1e-40, 2.0 ** -149, 0.0]
    z = np.concatenate([dense, small, -small, extremes, [-v for v in extremes]])
    return z.astype(np.float32)


def reference(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 gelu and gelu' of float32 z, from erfc (no cancellation in either tail)."""
    zd = torch.from_numpy(z.astype(np.float64))
    cdf = 0.5 * torch.special.erfc(-zd * 0.7071067811865476)
    pdf = torch.exp(-0.5 * zd * zd) * 0.3989422804014327
    return (zd * cdf).numpy(), (cdf + zd * pdf).numpy()


def _ulps(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|got - ref| in ulps of fp32 at max(|ref|, 2^-126) (denormals' spacing below)."""
    _, e = np.frexp(np.maximum(np.abs(ref), 2.0 ** -126))
    return np.abs(got.astype(np.float64) - ref) / np.ldexp(1.0, e - 24)


def accuracy(z: np.ndarray, y: np.ndarray, g: np.ndarray) -> dict:
    """Max errors of gelu (y) and gelu' (g) at z against float64; ``pass``: gelu within 4 ulp
    where |gelu| > 1e-30, gelu' within 4 ulp or 1e-7 at every point."""
    ref_y, ref_g = reference(z)
    uy, ug = _ulps(y, ref_y), _ulps(g, ref_g)
    ay, ag = np.abs(y - ref_y), np.abs(g - ref_g)
    bad = ~np.isfinite(y) | ~np.isfinite(g)
    uy[bad] = ug[bad] = np.inf
    counted = np.abs(ref_y) > 1e-30
    uy_c = np.where(counted, uy, 0.0)
    ug_beyond = np.where(ag > 1e-7, ug, 0.0)
    out = {"gelu_ulp": float(uy_c.max()), "gelu_ulp_at": float(z[uy_c.argmax()]),
           "gelu_abs": float(np.nanmax(ay)), "grad_ulp": float(ug.max()),
           "grad_ulp_at": float(z[ug.argmax()]), "grad_abs": float(np.nanmax(ag)),
           "grad_ulp_beyond_1e-7": float(ug_beyond.max())}
    for name, region in (("z<-3", z < -3), ("-3<=z<0", (z >= -3) & (z < 0)),
                         ("0<=z<=3", (z >= 0) & (z <= 3)), ("z>3", z > 3)):
        out[f"gelu_ulp {name}"] = float(uy_c[region].max())
    out["pass"] = bool(out["gelu_ulp"] <= 4 and out["grad_ulp_beyond_1e-7"] <= 4)
    return out


def evaluate(form: int, z: np.ndarray, device: str) -> tuple[np.ndarray, np.ndarray]:
    zt = torch.from_numpy(z).to(device)
    y, g = torch.empty_like(zt), torch.empty_like(zt)
    block = 65536 if INTERPRETED else 4096
    _eval_kernel[(triton.cdiv(zt.numel(), block),)](zt, y, g, zt.numel(), FORM=form,
                                                     BLOCK=block)
    return y.cpu().numpy(), g.cpu().numpy()


def exact_gelu_test(form: int, device: str) -> str:
    """``tests.helpers.check_exact_gelu`` on kernels with this formulation: "pass" or why not."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers import check_exact_gelu

    try:
        check_exact_gelu(_bias_gelu_with(form), device, 40001)
        return "pass"
    except AssertionError as err:
        return "fail: " + " ".join(str(err).split())[:300]


# ----------------------------------------------------------------------------- GPU model (CPU)
# Interpreted, exp2, exp, the divisions and erf are numpy's, correctly rounded. The model below
# replaces them with what the compiled kernels run on sm_90: tl.exp2 is ex2.approx.ftz.f32,
# tl.exp ex2.approx.f32 of x·log2(e) rounded, ``/`` div.full.f32, _rcp rcp.approx.ftz.f32 (within
# 2, 2, 2 and 1 ulp by CUDA's programming guide: exp2f, x/y and 1/x without -prec-div), erf
# libdevice's __nv_erff as its bitcode has it, linked with FTZ as Triton links it. Each result
# is the correctly rounded value moved by that many ulps, one sign for each unit, every
# combination of signs tried: a worst case, not a model of the hardware's error.

def _libdevice_erff_constants() -> dict:
    """__nv_erff's constants (libdevice.10.bc, as llvm-dis prints them: doubles' bits)."""
    bits = {"switch": "3FF00C1FC0000000",
            "big": ["3F1D698740000000", "BF55C00B60000000", "3F813233E0000000",
                    "BFA49B3340000000", "3FC46AA320000000", "3FED369F20000000",
                    "3FE4214280000000"],
            "small": ["3F163D2D40000000", "BF4AE9A400000000", "3F755ABD40000000",
                      "BF9B837CE0000000", "3FBCE315E0000000", "BFD8127580000000",
                      "3FC06EBA60000000"]}

    def f32(h):
        return np.float32(struct.unpack(">d", bytes.fromhex(h))[0])
    return {"switch": f32(bits["switch"]), "big": [f32(h) for h in bits["big"]],
            "small": [f32(h) for h in bits["small"]]}


def _fma32(a, b, c):
    """fp32 fma, rounded once (Triton's interpreter's own)."""
    from triton._C.libtriton import interpreter as _interp

    a, b, c = np.broadcast_arrays(*(np.asarray(v, dtype=np.float32) for v in (a, b, c)))
    return _interp.fma_fp32(np.ascontiguousarray(a), np.ascontiguousarray(b),
                            np.ascontiguousarray(c))


def _shift(r: np.ndarray, ulps: int) -> np.ndarray:
    """r moved by ``ulps`` units in the last place (finite nonzero values; sign kept)."""
    if ulps == 0:
        return r
    bits = r.view(np.int32).copy()
    ok = np.isfinite(r) & (r != 0)
    bits[ok] += ulps
    return bits.view(np.float32)


def _ex2(x: np.ndarray, ulps: int, ftz: bool) -> np.ndarray:
    with np.errstate(over="ignore"):
        r = np.exp2(x.astype(np.float64)).astype(np.float32)
    if ftz:
        r = np.where(r < 2.0 ** -126, np.float32(0.0), r)
    return _shift(r, ulps)


def _erff(a: np.ndarray, ulps: int) -> np.ndarray:
    """libdevice's __nv_erff, operation for operation (FTZ fma, ex2.approx.ftz)."""
    k = _libdevice_erff_constants()
    a = np.where(np.abs(a) < 2.0 ** -126, np.float32(0.0) * a, a).astype(np.float32)
    ax = np.abs(a)
    big = ax >= k["switch"]
    s = np.where(big, ax, a * a)
    coef = [np.where(big, cb, cs) for cb, cs in zip(k["big"], k["small"])]
    r = _fma32(coef[0], s, coef[1])
    for c in coef[2:]:
        r = _fma32(r, s, c)
    m = np.where(big, -ax, a)
    r = _fma32(r, m, m)
    one_minus = (np.float32(1.0) - _ex2(r, ulps, ftz=True)).astype(np.float32)
    return np.where(big, np.copysign(one_minus, a), r).astype(np.float32)


@contextlib.contextmanager
def gpu_primitives(ex2_ulps: int, rcp_ulps: int):
    """The interpreter's exp2, exp, divisions and erf replaced by the GPU model above."""
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    log2e = np.float32(1.4426950408889634)

    def unary(fn):
        return lambda self, arg: interp.TensorHandle(fn(arg.data), arg.dtype.scalar)

    def div(ulps):
        return lambda self, lhs, rhs: self.binary_op(
            lhs, rhs, lambda a, b: _shift(np.divide(a, b).astype(np.float32), ulps))

    patches = {
        "create_exp2": unary(lambda x: _ex2(x, ex2_ulps, ftz=True)),  # ex2.approx.ftz.f32
        "create_exp": unary(lambda x: _ex2((x * log2e).astype(np.float32), ex2_ulps, False)),
        "create_erf": unary(lambda x: _erff(x, ex2_ulps)),
        "create_approx_divf": div(rcp_ulps),  # stands for MUFU.RCP (see _rcp)
        "create_fdiv": div(2 * rcp_ulps),  # div.full.f32
    }
    saved = {name: getattr(builder, name) for name in patches}
    try:
        for name, fn in patches.items():
            setattr(builder, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(builder, name, fn)


def _worst(results: list[dict]) -> dict:
    out = {}
    for key in results[0]:
        values = [r[key] for r in results]
        if key == "pass":
            out[key] = all(values)
        elif key.endswith("_at"):
            continue
        else:
            i = int(np.argmax(values))
            out[key] = values[i]
            if key + "_at" in results[i]:
                out[key + "_at"] = results[i][key + "_at"]
    return out


def check(forms: list[str]) -> dict:
    """CPU accuracy of each formulation: {"exact": ..., "gpu_model": ..., "check_exact_gelu":
    {"exact": ..., "gpu_model": ...}}."""
    assert INTERPRETED, "--check runs in Triton's interpreter (TRITON_INTERPRET=1)"
    z = eval_points()
    out = {}
    for name in forms:
        form = FORMS[name]
        row = {"exact": accuracy(z, *evaluate(form, z, "cpu"))}
        runs, tests = [], []
        for ex2_ulps, rcp_ulps in itertools.product((2, -2), (1, -1)):
            with gpu_primitives(ex2_ulps, rcp_ulps):
                runs.append(accuracy(z, *evaluate(form, z, "cpu")))
                tests.append(exact_gelu_test(form, "cpu"))
        row["gpu_model"] = _worst(runs)
        row["check_exact_gelu"] = {
            "exact": exact_gelu_test(form, "cpu"),
            "gpu_model": next((t for t in tests if t != "pass"), "pass")}
        out[name] = row
    return out


def _print_check(results: dict) -> None:
    cols = ("gelu_ulp", "gelu_ulp z<-3", "gelu_ulp -3<=z<0", "gelu_ulp 0<=z<=3", "gelu_abs",
            "grad_ulp", "grad_abs", "grad_ulp_beyond_1e-7", "pass")
    print(f"{'formulation':14s} {'primitives':10s} " + " ".join(f"{c:>14s}" for c in cols))
    for name, row in results.items():
        for mode in ("exact", "gpu_model"):
            r = row[mode]
            cells = [f"{r[c]!s:>14s}" if isinstance(r[c], bool) else f"{r[c]:14.3g}"
                     for c in cols]
            print(f"{name:14s} {mode:10s} " + " ".join(cells))
        print(f"{'':14s} check_exact_gelu: {row['check_exact_gelu']}")


# ----------------------------------------------------------------------------- SASS (CPU)

def _compile_sm90(kernel, sig: dict, constexprs: dict, warps: int) -> tuple[str, int]:
    """(SASS, registers a thread) of ``kernel`` compiled for sm_90 without a GPU, pointers and
    integers taken as multiples of 16 (as Triton specializes them at these shapes)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if sig[k] != "constexpr"}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, attrs=attrs,
                                        constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    return sass, int(re.search(r"REG:(\d+)", usage).group(1))


def sass_counts(forms: list[str]) -> dict:
    """SASS instructions of the forward and backward kernels compiled for sm_90 at the library's
    tiles (bf16 x, without software pipelining, so the loop body appears once), per element a
    thread handles: each formulation's total and its excess over ``identity`` by opcode; and
    registers a thread at the library's settings (pipelining included)."""
    common = {"n_rows": "i32", "D": "i32", "rows_per_prog": "i32", "FORM": "constexpr",
              "STAGES": "constexpr", "BLOCK_R": "constexpr", "BLOCK_D": "constexpr"}
    kernels = {"fwd": (_fwd_kernel, {"x_ptr": "*bf16", "b_ptr": "*fp32", "y_ptr": "*bf16",
                                     **common}),
               "bwd": (_bwd_kernel, {"dy_ptr": "*bf16", "x_ptr": "*bf16", "b_ptr": "*fp32",
                                     "dx_ptr": "*bf16", "db_ptr": "*fp32", **common})}
    fwd_settings, bwd_settings = settings()
    out = {}
    for pass_, (kernel, sig) in kernels.items():
        s = (fwd_settings if pass_ == "fwd" else bwd_settings)[0]
        block_d = s["block_d"]
        block_r = s["elements"] // block_d
        per_thread = s["elements"] / (32 * s["warps"])
        counts, regs = {}, {}
        for name in ["identity"] + [f for f in forms if f != "identity"]:
            consts = {"FORM": FORMS[name], "BLOCK_R": block_r, "BLOCK_D": block_d}
            sass, _ = _compile_sm90(kernel, sig, {**consts, "STAGES": 1}, s["warps"])
            _, regs[name] = _compile_sm90(kernel, sig, {**consts, "STAGES": s["stages"]},
                                          s["warps"])
            ops: dict[str, int] = {}
            for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_]+)",
                                 sass):
                ops[m.group(1)] = ops.get(m.group(1), 0) + 1
            counts[name] = ops
        base = counts["identity"]
        for name, ops in counts.items():
            extra = {op: (n - base.get(op, 0)) / per_thread for op in set(ops) | set(base)
                     if (n := ops.get(op, 0)) != base.get(op, 0)}
            out[f"{pass_} {name}"] = {
                "per_element": sum(ops.values()) / per_thread,
                "over_identity": (sum(ops.values()) - sum(base.values())) / per_thread,
                "mufu": ops.get("MUFU", 0) / per_thread, "registers": regs[name],
                "by_opcode": dict(sorted(extra.items(), key=lambda kv: -abs(kv[1])))}
    return out


def fit_minimax(k: float = 0.5, n: int = 11, z_max: float = 13.5, points: int = 4000,
                iterations: int = 20000) -> tuple[float, list[float]]:
    """(max relative error, coefficients) of P(t), t = 1/(1 + k|z|), fitted to
    0.5·erfc(|z|/√2) / (t·2^(z²·c)) with c = fp32(-log2(e)/2) as the kernels compute E: Lawson's
    iteratively reweighted least squares (which converges to the minimax fit) in a Chebyshev
    basis over t for |z| ≤ z_max, the target from mpmath at 40 digits."""
    import mpmath as mp

    mp.mp.dps = 40
    c = mp.mpf(float(np.float32(-0.7213475204444817)))
    lo = 1 / (1 + k * z_max)
    t = np.sort(np.cos(np.linspace(0, np.pi, points)) * 0.5 * (1 - lo) + 0.5 * (1 + lo))

    def target(tv):
        z = (1 / mp.mpf(tv) - 1) / k
        return float(0.5 * mp.erfc(z / mp.sqrt(2)) / mp.mpf(tv) / mp.power(2, c * z * z))

    g = np.array([target(float(v)) for v in t])
    basis = np.polynomial.chebyshev.chebvander((2 * t - (1 + lo)) / (1 - lo), n - 1) / g[:, None]
    w = np.full(points, 1.0 / points)
    best = (np.inf, None)
    for _ in range(iterations):
        coef = np.linalg.lstsq(basis * np.sqrt(w)[:, None], np.sqrt(w), rcond=None)[0]
        r = np.abs(basis @ coef - 1)
        if r.max() < best[0]:
            best = (r.max(), coef)
        w = w * r + 1e-300
        w /= w.sum()
    cheb = np.polynomial.chebyshev.cheb2poly(best[1])  # in s = (2t - 1 - lo) / (1 - lo)
    power = np.polynomial.Polynomial(cheb)(np.polynomial.Polynomial([-(1 + lo) / (1 - lo),
                                                                      2 / (1 - lo)]))
    return float(best[0]), [float(v) for v in np.float32(power.coef)]


# ----------------------------------------------------------------------------- GPU benchmark

def cpu_check_rows() -> dict:
    """``--check --json`` in a child process (the interpreter is fixed at import)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    try:
        out = subprocess.run([sys.executable, __file__, "--check", "--json"], env=env,
                             capture_output=True, text=True, timeout=600)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as err:
        return {"error": str(err)[:200]}


def bench(args) -> int:
    env = environment(DEVICE)
    cpu = {} if args.no_cpu_check else cpu_check_rows()
    z = eval_points()
    gpu_acc = {}
    for name, form in FORMS.items():
        if name != "identity":
            gpu_acc[name] = {**accuracy(z, *evaluate(form, z, DEVICE)),
                             "check_exact_gelu": exact_gelu_test(form, DEVICE)}

    def record(row: dict, ms: float | None, moved: int) -> None:
        row = {"kind": "erf-tune", **row, "ms": ms,
               "gb_per_s": None if ms is None else moved / ms / 1e6, "env": env}
        append_rows(args.out, [row])  # row by row: a run cut short keeps what it measured
        print(json.dumps({k: v for k, v in row.items()
                          if k not in ("env", "accuracy_gpu", "accuracy_cpu")}), flush=True)

    def timed(fn) -> tuple[float | None, str | None]:
        try:
            return graph_ms(fn), None
        except Exception as err:  # noqa: BLE001 - a setting that fails is a result
            return None, str(err).splitlines()[0][:200]

    def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
        """Against the float64 values rounded to bf16: max |difference| and the share of
        outputs that are not that rounding."""
        return {"max_err": (out.float() - ref.float()).abs().max().item(),
                "bf16_differs": (out != ref).float().mean().item()}

    fwd_settings, bwd_settings = settings()
    for model, n, d in SHAPES:
        x = torch.randn(n, d, device=DEVICE, dtype=torch.bfloat16)
        b = 0.1 * torch.randn(d, device=DEVICE)
        dy = torch.randn(n, d, device=DEVICE, dtype=torch.bfloat16)
        y, dx = torch.empty_like(x), torch.empty_like(x)
        shape = {"model": model, "rows": n, "dim": d}
        zd = (x.float() + b).double()  # z as the kernels form it (fp32), then float64 math
        cdf = 0.5 * torch.special.erfc(-zd * 0.7071067811865476)
        ref_y = (zd * cdf).to(x.dtype)
        ref_dx = (dy.double() * (cdf + zd * torch.exp(-0.5 * zd * zd) * 0.3989422804014327)
                  ).to(x.dtype)
        del zd, cdf
        ms, _ = timed(lambda: y.copy_(x))
        record({**shape, "pass": "fwd", "formulation": "torch copy (ceiling)"}, ms, 4 * n * d)
        ms, _ = timed(lambda: torch.add(dy, x, out=dx))
        record({**shape, "pass": "bwd", "formulation": "torch add (ceiling)"}, ms, 6 * n * d)
        ms, _ = timed(lambda: torch.ops.fasttrain.bias_gelu_fwd(x, b, "none"))
        record({**shape, "pass": "fwd", "formulation": "library op",
                **errors(torch.ops.fasttrain.bias_gelu_fwd(x, b, "none"), ref_y)}, ms, 4 * n * d)
        ms, _ = timed(lambda: torch.ops.fasttrain.bias_gelu_bwd(dy, x, b, "none"))
        record({**shape, "pass": "bwd", "formulation": "library op",
                **errors(torch.ops.fasttrain.bias_gelu_bwd(dy, x, b, "none")[0], ref_dx)},
               ms, 6 * n * d)
        for (pass_, ss), (name, form) in itertools.product(
                (("fwd", fwd_settings), ("bwd", bwd_settings)), FORMS.items()):
            for s in ss:
                if pass_ == "fwd":
                    run, out, ref, moved = fwd_call(form, s, x, b, y), y, ref_y, 4 * n * d
                else:
                    run, out, ref, moved = bwd_call(form, s, dy, x, b, dx), dx, ref_dx, 6 * n * d
                ms, err = timed(run)
                extra = {"error": err} if err else {}
                if err is None:
                    kernel = run()
                    extra = {"registers": getattr(kernel, "n_regs", None),
                             "spills": getattr(kernel, "n_spills", None)}
                if err is None and name != "identity":
                    extra.update({**errors(out, ref), "accuracy_gpu": gpu_acc[name],
                                  "accuracy_cpu": cpu.get(name, cpu)})
                record({**shape, "pass": pass_, "formulation": name, **s, **extra}, ms, moved)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSONL file the rows are appended to")
    ap.add_argument("--check", action="store_true", help="CPU accuracy check (interpreter)")
    ap.add_argument("--json", action="store_true", help="with --check: one JSON line at the end")
    ap.add_argument("--sass", action="store_true", help="CPU: SASS instructions an element")
    ap.add_argument("--fit", action="store_true", help="CPU: recompute minimax's coefficients")
    ap.add_argument("--forms", default=",".join(FORMS), help="formulations for --check/--sass")
    ap.add_argument("--no-cpu-check", action="store_true",
                    help="GPU run: skip the CPU check's numbers in the rows")
    args = ap.parse_args()
    forms = [f for f in args.forms.split(",") if f]
    if args.check:
        results = check([f for f in forms if f != "identity"])
        _print_check(results)
        if args.json:
            print(json.dumps(results))
        if args.out:
            append_rows(args.out, [{"kind": "erf-tune-check", "formulation": k, **v,
                                    "env": environment("cpu")} for k, v in results.items()])
        return 0
    if args.sass:
        counts = sass_counts(forms)
        for key, c in counts.items():
            top = ", ".join(f"{op} {v:+.2f}" for op, v in list(c["by_opcode"].items())[:8])
            print(f"{key:20s} {c['per_element']:6.2f}/element ({c['over_identity']:+6.2f} over "
                  f"identity, MUFU {c['mufu']:.2f}, {c['registers']:3d} registers): {top}")
        if args.out:
            append_rows(args.out, [{"kind": "erf-tune-sass", "kernel": k, **v,
                                    "env": environment("cpu")} for k, v in counts.items()])
        return 0
    if args.fit:
        err, coef = fit_minimax()
        print(f"max relative error {err:.3g}; coefficients, t^0 first: {coef}")
        return 0
    if not args.out:
        ap.error("--out is required for the GPU benchmark")
    return bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
