"""What every Triton kernel module here shares: op registration and launches.

Under ``TRITON_INTERPRET=1`` (CPU), ``@triton.jit`` gives an interpreted function that
``wrap_triton`` hands back unwrapped, so torch.compile cannot trace a ``triton_op`` through it
(it would touch fake tensors' data). There the ops are opaque ``custom_op``s instead, whose
fake (shape-only) call skips the launch: still no graph break, but a black box to the compiler.
On a GPU they are ``triton_op``s, so Inductor sees the Triton kernels themselves.

Scalars: Inductor hands a kernel's Python float arguments over as fp64 (the interpreter as
Python floats), so kernels cast them with ``tl.cast(x, tl.float32)`` before use: fp64 arithmetic
is slow, and it changes the type of loop-carried values (a compile error).

Interpreted or compiled is fixed when this module is imported (as Triton fixes it at
``@triton.jit``): set ``TRITON_INTERPRET=1`` before importing any ``fasttrain.kernels`` module.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.library import custom_op, triton_op, wrap_triton
from triton.runtime.jit import JITFunction


@triton.jit
def _probe(x_ptr):
    tl.store(x_ptr, 0)


INTERPRETED = not isinstance(_probe, JITFunction)
"""Whether this process runs Triton kernels in the interpreter (on the CPU)."""


# Reductions for the kernels: tl.reduce (a builtin of triton.language) with these combine
# functions, not the @triton.jit library's tl.sum and tl.max (compiled-only when triton was
# imported before TRITON_INTERPRET was set). Interpreted, the combine functions are the ones
# tl.sum and tl.max reduce with, which the interpreter recognises and runs as one numpy call per
# tile, where a combine function of ours is called once per element (a 64 × 32 LayerNorm tile:
# 0.9 s against 25 ms); INTERPRETED is true exactly when the library runs interpreted too.
# Compiled, they are ours: Inductor copies a kernel's @triton.jit helpers into its own source
# under their function names, so a kernel that calls ``add`` needs a function named ``add``.
if INTERPRETED:
    add = tl.standard._sum_combine
    maximum = tl.standard._elementwise_max
else:
    @triton.jit
    def add(a, b):
        return a + b

    @triton.jit
    def maximum(a, b):
        return tl.maximum(a, b)


@triton.jit
def sum0(v):
    """Sum over axis 0 (a row vector's elements, a tile's columns)."""
    return tl.reduce(v, 0, add)


@triton.jit
def tile_dot(a, b, DOT: tl.constexpr):
    """a @ b with fp32 accumulation. DOT: 0 tensor cores in the inputs' 16-bit dtype, 1 full
    fp32 (no TF32), 2 upcast first (the interpreter's dot mishandles bfloat16)."""
    if DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif DOT == 1:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def to_bf16(x):
    """fp32 → bf16 rounded to nearest even, as ``Tensor.to(torch.bfloat16)`` (a NaN stays a NaN,
    with its own payload), in integer arithmetic: the same bits compiled and in Triton's
    interpreter, which truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return tl.where(x != x, 0x7FC0, bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def mix32(x):
    """A uint32 hash of uint32 ``x`` (MurmurHash3's finaliser): every input bit flips about
    half of the output bits, so consecutive inputs give unrelated outputs."""
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return x


@triton.jit
def to_bf16_stochastic(x, noise):
    """fp32 → bf16 rounded stochastically: up (away from zero) with probability equal to the
    fraction of the way ``x`` lies to the next bf16 value, so the expectation is ``x`` itself.
    ``noise`` is uniform in 0 … 65,535 (uint32): it is added to the 16 bits that bf16 drops,
    and a carry out of them rounds up. Infinities stay, a NaN stays a NaN."""
    bits = x.to(tl.uint32, bitcast=True) + noise
    return tl.where(x != x, 0x7FC0, bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


# ``rounded(v, dtype)``: fp32 v in ``dtype`` as torch's ``.to()`` rounds it. Compiled, Triton's
# own cast; interpreted, bf16 through ``to_bf16`` (the interpreter's cast truncates).
if INTERPRETED:
    @triton.jit
    def rounded(v, dtype: tl.constexpr):
        if dtype == tl.bfloat16:
            return to_bf16(v)
        return v.to(dtype)
else:
    @triton.jit
    def rounded(v, dtype: tl.constexpr):
        return v.to(dtype)


def output_grad(saved: torch.Tensor, dy: torch.Tensor | None) -> torch.Tensor:
    """An output's gradient as a kernel reads it: contiguous (autograd may hand in an expanded
    one), zeros like ``saved`` where autograd hands in none."""
    return torch.zeros_like(saved) if dy is None else dy.contiguous()


def realized(t: torch.Tensor) -> torch.Tensor:
    """An op's input that more than one of its kernels reads, as one buffer with its own strides
    under torch.compile; t itself in eager. Inductor fixes a user kernel's arguments to their
    traced strides one launch at a time, so a value it has not written yet (a convolution's bias
    add, a residual sum) would be written once for every kernel, and every argument, taking it;
    its ``force_stride_order`` prim writes it once, before the launches."""
    if not (torch.compiler.is_compiling() or isinstance(t, (FakeTensor, FunctionalTensor))):
        return t
    from torch._inductor import inductor_prims  # noqa: F401  (registers the prim)

    return torch.ops.prims.inductor_force_stride_order(t, t.stride())


def unavailable_on(device_type: str) -> str | None:
    """Why the Triton kernels cannot run on this device type in this process, or None if they
    can. Interpreted kernels run on host memory only: handed CUDA tensors, the interpreter
    works on host copies while kernels that address tensors by raw offsets (the one-launch
    AdamW's table) read and write arbitrary host memory."""
    if INTERPRETED:
        return None if device_type == "cpu" else ("this process runs Triton's interpreter "
                                                  f"(TRITON_INTERPRET=1), not on {device_type}")
    return None if device_type == "cuda" else \
        f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1), not {device_type}"


def runs_on(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``t``'s device in this process."""
    return unavailable_on(t.device.type) is None


def op(name: str, opaque: bool = False):
    """Decorator: register ``fn`` as the custom op ``name`` (see the module docstring).
    ``opaque``: a ``custom_op`` on a GPU too, whose kernels Inductor does not see but runs as
    the op's Python body at run time — for launches that need options Inductor's user-kernel
    path drops (a register cap, ``maxnreg``); its ``launch`` calls pass ``opaque=True``."""
    if not INTERPRETED and not opaque:
        return triton_op(name, mutates_args=())

    def register(fn):
        registered = custom_op(name, fn, mutates_args=())
        registered.register_fake(fn)
        return registered
    return register


def launch(kernel, grid: tuple[int, ...], *args, opaque: bool = False, maxnreg: int = 0,
           **meta) -> None:
    """Launch ``kernel`` over ``grid`` (traceable by torch.compile on a GPU). ``opaque``: from
    an ``op(..., opaque=True)``, a plain launch, where ``maxnreg`` (if not 0) caps the registers
    a thread (so more programs fit an SM; ignored by the interpreter)."""
    if maxnreg and not opaque:
        raise ValueError(f"{kernel.fn.__name__}: maxnreg needs an opaque launch (Inductor "
                         "drops it)")
    if (INTERPRETED or opaque) and any(isinstance(a, FakeTensor) for a in args):
        return  # fake (shape-only) call of an opaque op
    if opaque and not INTERPRETED:
        kernel[grid](*args, **meta, **({"maxnreg": maxnreg} if maxnreg else {}))
    else:
        wrap_triton(kernel)[grid](*args, **meta)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs_cap(device: torch.device, per_sm: int = 4) -> int:
    """How many persistent programs fill ``device``: a few per SM on a GPU; the interpreter
    runs programs one after another, so a handful there."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return per_sm * _sm_count(index)
