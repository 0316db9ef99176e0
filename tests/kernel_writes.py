"""Which inputs Inductor believes each of fasttrain's Triton kernels writes (run as a script).

torch.compile traces a ``triton_op``'s kernels and asks ``triton_kernel_wrap`` which tensor
arguments each one stores to. That analysis walks back from every store's address through the
kernel's TTIR, and through *every* argument of a ``@triton.jit`` helper whose result fed it; an
input it wrongly marks as written is copied before each launch where it is still needed (a
saved activation in the backward, say): a whole extra read and write of the tensor, invisible
in the results. This script launches every kernel of ``fasttrain.kernels`` that goes through
``_triton.launch`` with small CPU tensors, runs the analysis instead of the kernel (compiled
Triton, so not under ``TRITON_INTERPRET``; a CPU-only machine gets a stand-in sm90 target:
TTIR needs no GPU) and prints one JSON line per launch: the kernel, the arguments the analysis
says it writes, and those among them that are the op's inputs (which must be none).
"""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys

import torch
import triton

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the analysis reads compiled kernels' TTIR")


def _target() -> None:
    """A compile target for TTIR when there is no GPU (no kernel is ever launched)."""
    if torch.cuda.is_available():
        return
    from triton.backends.compiler import GPUTarget

    class _Stand:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(_Stand())


def _analyse(kernel, kwargs: dict) -> list[str]:
    """The names of the arguments the analysis of this torch marks written."""
    import torch._higher_order_ops.triton_kernel_wrap as wrap

    if hasattr(wrap, "identify_accessed_tensors"):  # torch ≥ 2.12
        accesses = wrap.identify_accessed_tensors(kernel, kwargs, {})
        return [dep.name for dep in accesses.read_writes.writes]
    return list(wrap.identify_mutated_tensors(kernel, kwargs, {}))


def main() -> None:
    _target()
    import fasttrain.kernels as package
    from fasttrain.kernels import (_triton, activations, geglu, group_norm, narrow_conv, norms,
                                   rope, seq_attention, window_attention)

    # every kernel module that launches through _triton.launch: one added later shows up below
    # as kernels never launched until main() calls its ops
    modules = [m for m in (importlib.import_module(f"{package.__name__}.{info.name}")
                           for info in pkgutil.iter_modules(package.__path__)
                           if not info.name.startswith("_"))
               if getattr(m, "launch", None) is _triton.launch]
    inputs: list[int] = []  # storages of the running op's inputs
    rows: list[dict] = []

    def analysed_launch(kernel, grid, *args, **meta):
        kwargs = dict(zip(kernel.arg_names, args))
        kwargs.update((k, v) for k, v in meta.items() if k in kernel.arg_names)
        written = _analyse(kernel, kwargs)
        wrong = [n for n in written if isinstance(kwargs[n], torch.Tensor)
                 and kwargs[n].untyped_storage().data_ptr() in inputs]
        rows.append({"kernel": f"{kernel.fn.__module__.split('.')[-1]}.{kernel.fn.__name__}",
                     "writes": written, "inputs_written": wrong})

    for module in modules:
        module.launch = analysed_launch
        if hasattr(module, "programs_cap"):
            module.programs_cap = lambda device, per_sm=4: 132 * per_sm

    def call(op, *args):
        inputs[:] = [a.untyped_storage().data_ptr() for a in args
                     if isinstance(a, torch.Tensor) and a.numel()]
        return op(*args)

    bf, f32 = torch.bfloat16, torch.float32
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=bf):
        return torch.randn(*shape, generator=g).to(dtype)

    x, b = rnd(256, 512), rnd(512, dtype=f32)
    for bias in (b, None):
        call(activations._bias_gelu_fwd, x, bias, "none")
        call(activations._bias_gelu_bwd, rnd(256, 512), x, bias, "none")
    call(activations._swiglu_fwd, x, rnd(256, 512))
    call(activations._swiglu_bwd, rnd(256, 512), x, rnd(256, 512))
    for bias in (b, None):
        call(geglu._geglu_fwd, x, bias, "none")
        call(geglu._geglu_bwd, rnd(256, 256), x, bias, "none")

    w, h = rnd(512, dtype=f32), rnd(256, 512, dtype=f32)
    mean, rstd = rnd(256, dtype=f32), rnd(256, dtype=f32).abs()
    call(norms._ln_fwd, x, b, h, w, b, 1e-5, bf)
    call(norms._ln_fwd, x, None, None, w, None, 1e-5, None)
    call(norms._ln_bwd, x, h.clone(), h, w, mean, rstd, True)
    call(norms._ln_bwd, x, None, h, w, mean, rstd, False)
    call(norms._rms_fwd, x, h, w, 1e-5, bf)
    call(norms._rms_bwd, x, None, h, w, rstd)
    call(norms._ln_bwd, x, h.clone(), h, w, mean, rstd, True, bf)  # x's gradient in bf16 too
    call(norms._rms_bwd, x, h.clone(), h, w, rstd, bf)

    qkv, pos = rnd(2, 14, 14, 3 * 64), rnd(2, 49, 49, dtype=f32)
    shift_mask = torch.zeros(4, 49, 49)
    out, lse = call(window_attention._fwd, qkv, pos, shift_mask, 2, 0.18, [14, 14, 7, 7, 3])
    call(window_attention._bwd, rnd(2, 14, 14, 64), qkv, out, lse, pos, shift_mask, 2, 0.18,
         [14, 14, 7, 7, 3])

    for T, batch_second, sums in ((197, False, False), (64, True, False),  # a partial block; none
                                  (197, False, True)):  # the bias gradient's column sums
        qkv = rnd(T, 2, 3 * 128) if batch_second else rnd(2, T, 3 * 128)
        out, lse = call(seq_attention._fwd, qkv, None, 2, 0.125, batch_second)
        call(seq_attention._bwd, rnd(*out.shape), qkv, out, lse, 2, 0.125, batch_second, sums)

    q, k = rnd(2, 4, 16, 64), rnd(2, 2, 16, 64)
    cos, sin = rnd(16, 32, dtype=f32), rnd(16, 32, dtype=f32)
    call(rope._rope_fwd, q, k, cos, sin)
    call(rope._rope_bwd, q, k, cos, sin)

    xg = rnd(2, 64, 8, 8).contiguous(memory_format=torch.channels_last)
    wg, bg = rnd(64, dtype=f32), rnd(64, dtype=f32)
    for xb in (None, rnd(2, 64, dtype=f32)):  # with a per-sample x_bias (the UNet's ResNets)
        _, pc = call(group_norm._fwd, xg, wg, bg, xb, 32, 1e-5, True)
        call(group_norm._bwd, rnd(2, 64, 8, 8).contiguous(memory_format=torch.channels_last),
             xg, wg, pc, 32, True)

    call(narrow_conv._conv, rnd(2, 3, 9, 8).contiguous(memory_format=torch.channels_last),
         rnd(16, 3, 3, 3), rnd(16), 1, 1)

    launched = {r["kernel"] for r in rows}
    for module in modules:  # with the kernels it imports from a private module of kernels
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "arg_names"):
                key = f"{obj.fn.__module__.split('.')[-1]}.{name}"
                if key not in launched:
                    rows.append({"kernel": key, "writes": None, "inputs_written": None})
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
