"""A convolution over few input channels in one Triton pass, forward only (a frozen encoder's
input convolution: SD's VAE, 3 → 128 channels, 3 × 3, 512 px).

What is fused
    ``layers.conv.GemmConv2d`` computes such a convolution as a gather of the 27 input values
    of every output pixel into a (pixels × 32) matrix (nine slice copies, one permute copy) and
    one GEMM with the bias in its epilogue: at the VAE's input, 0.49 ms a step, of which the
    GEMM alone is 0.315 ms, twice the time of writing its 537 MB output at the copy ceiling
    (profile-sd-base-20261122-094525). ``narrow_conv2d`` gathers each tile's input values
    straight from the input in its own layout (a few MB, cache-resident), multiplies them by
    the filters on tensor cores (K = C·kh·kw padded to a power of two, at most 64) and writes
    the output tile, bias added, channels-last: one pass that writes the output once and reads
    nothing else of size.

Numerics
    The products of the input and the filters summed in fp32 (in another order than cuDNN's or
    the GEMM's), the bias added in fp32, rounded once to the input's dtype: as the GEMM with
    the bias in its epilogue. Padded positions and padded columns are exact zeros. fp32 inputs
    multiply in full fp32 (no TF32).

Limits
    Forward only: for a convolution whose input and weights need no gradient (a frozen module,
    inference). Stride 1, no dilation, one group, zero padding, fewer than 8 input channels and
    at most 64 = C·kh·kw values per output pixel; the input in any layout, the output
    (N, O, Ho, Wo) channels-last in the input's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._triton import INTERPRETED, launch, op, tile_dot

__all__ = ["narrow_conv2d", "narrow_conv2d_reference", "LAUNCH", "MAX_CHANNELS", "MAX_TAPS"]

MAX_CHANNELS = 7  # 8 bf16 channels fill a 16-byte load: cuDNN's NHWC kernels take those
MAX_TAPS = 64  # C·kh·kw: the K of one tensor-core product
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

LAUNCH = {"block_m": 64, "max_block_n": 128, "tiles": 16, "warps": 2}
"""Output pixels and channels a tile, tiles a program (one after another, the filters loaded
once), and a program's warps. At SD's VAE input on an H200 (kernels-micro-conv-20261122-1321):
0.209 ms, 2.6 TB/s; one tile of 128 pixels a program with 4 warps 0.265 ms; 4 warps for 64
pixels or 8 for 128 slower again (0.243, 0.374 ms); 16 to 64 tiles of 64 pixels a program all
within 0.003 ms of this."""


@triton.jit
def _conv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, P, Ho, Wo, H, W, O,
                 sN, sC, sH, sW, wO, wC, wH, wW,
                 C: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, PH: tl.constexpr,
                 PW: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
                 TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """TILES consecutive (BLOCK_M pixels × BLOCK_N channels) tiles of the (pixels × O) output,
    from program_id(0)·TILES on, column block program_id(1): the filters are loaded once for
    all of them. Pixel p is (n, ho, wo) in row-major order; column k of the gathered input is
    channel k % C at tap k // C (row-major over kh × kw), as the weight's (O, kh, kw, C)
    order."""
    k = tl.arange(0, BLOCK_K)
    kmask = k < C * KH * KW
    c = k % C
    i = (k // C) // KW
    j = (k // C) % KW
    o = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    omask = o < O
    w = tl.load(w_ptr + o[None, :] * wO + (c * wC + i * wH + j * wW)[:, None],
                mask=kmask[:, None] & omask[None, :], other=0.0)
    if HAS_BIAS:
        b = tl.load(b_ptr + o, mask=omask, other=0.0).to(tl.float32)
    for t in range(TILES):
        pix = (tl.program_id(0).to(tl.int64) * TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        pmask = pix < P
        wo = pix % Wo
        ho = (pix // Wo) % Ho
        n = pix // (Wo * Ho)
        hi = ho[:, None] + (i - PH)[None, :]
        wi = wo[:, None] + (j - PW)[None, :]
        amask = pmask[:, None] & kmask[None, :] & (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
        a = tl.load(x_ptr + n[:, None] * sN + c[None, :] * sC + hi * sH + wi * sW, mask=amask,
                    other=0.0)
        acc = tile_dot(a, w, DOT)
        if HAS_BIAS:
            acc += b[None, :]
        tl.store(y_ptr + pix[:, None] * O + o[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=pmask[:, None] & omask[None, :])


def _blocks(O: int, K: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): O's next power of two up to ``max_block_n`` (the last column block
    masked), K's next power of two from 16 (a tensor-core product's least K)."""
    return (min(LAUNCH["max_block_n"], max(16, triton.next_power_of_2(O))),
            max(16, triton.next_power_of_2(K)))


@op("fasttrain::narrow_conv2d")
def _conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], ph: int,
          pw: int) -> torch.Tensor:
    N, C, H, W = x.shape
    O, _, KH, KW = weight.shape
    Ho, Wo = H + 2 * ph - KH + 1, W + 2 * pw - KW + 1
    y = torch.empty((N, O, Ho, Wo), dtype=x.dtype, device=x.device,
                    memory_format=torch.channels_last)  # element (n, o, ho, wo) at p·O + o
    P = N * Ho * Wo
    if P > 0 and O > 0:
        block_n, block_k = _blocks(O, C * KH * KW)
        dot = 1 if x.dtype == torch.float32 else 2 if INTERPRETED else 0
        per = LAUNCH["block_m"] * LAUNCH["tiles"]
        launch(_conv_kernel, (triton.cdiv(P, per), triton.cdiv(O, block_n)),
               x, weight, weight if bias is None else bias, y, P, Ho, Wo, H, W, O,
               *x.stride(), *weight.stride(), C=C, KH=KH, KW=KW, PH=ph, PW=pw,
               HAS_BIAS=bias is not None, DOT=dot, TILES=LAUNCH["tiles"], BLOCK_M=LAUNCH["block_m"],
               BLOCK_N=block_n, BLOCK_K=block_k, num_warps=LAUNCH["warps"])
    return y


def _check(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           padding: tuple[int, int]) -> None:
    if x.dim() != 4 or weight.dim() != 4:
        raise ValueError(f"narrow_conv2d takes a (N, C, H, W) input and (O, C, kh, kw) "
                         f"weights, got shapes {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (
            bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"narrow_conv2d needs the input, weights and bias in one of fp32, "
                         f"bf16, fp16; got {x.dtype}, {weight.dtype}"
                         + ("" if bias is None else f", {bias.dtype}"))
    C, (O, wc, kh, kw) = x.shape[1], weight.shape
    if wc != C:
        raise ValueError(f"narrow_conv2d: the input has {C} channels, the weights {wc}")
    if C > MAX_CHANNELS or C * kh * kw > MAX_TAPS:
        raise ValueError(f"narrow_conv2d takes up to {MAX_CHANNELS} input channels and "
                         f"{MAX_TAPS} values a pixel; got {C} channels × {kh} × {kw}")
    if bias is not None and tuple(bias.shape) != (O,):
        raise ValueError(f"narrow_conv2d: bias of shape {tuple(bias.shape)} for {O} filters")
    ph, pw = padding
    if min(ph, pw) < 0 or ph >= kh or pw >= kw:
        raise ValueError(f"narrow_conv2d: padding {padding} for a {kh} × {kw} kernel")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, weight, bias)):
        raise ValueError("narrow_conv2d is forward-only: call it under torch.no_grad() or on "
                         "tensors that need no gradient")


def narrow_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  padding: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, padding=padding)`` (stride 1) for an input of at most
    ``MAX_CHANNELS`` channels, in one Triton pass; the output is channels-last in x's dtype.
    Forward only (see the module docstring)."""
    _check(x, weight, bias, padding)
    return torch.ops.fasttrain.narrow_conv2d(x, weight, bias, int(padding[0]), int(padding[1]))


def narrow_conv2d_reference(x: torch.Tensor, weight: torch.Tensor,
                            bias: Optional[torch.Tensor] = None,
                            padding: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """The plain PyTorch convolution ``narrow_conv2d`` computes."""
    return torch.nn.functional.conv2d(x, weight, bias, padding=padding)
