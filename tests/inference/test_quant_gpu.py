"""The quantized linear layers' CUDA paths (marker ``gpu``; skipped without a GPU): the
``torch._scaled_mm`` (row-wise fp8) and ``torch._int_mm`` calls against the reference arithmetic
of the same quantization, at ViT-B's width and at token counts the kernels constrain (M ≤ 16,
M not a multiple of 16), and torch.compile (max-autotune, fullgraph) on a (64, 197, 768) batch.
A sibling of test_quant.py, which checks the quantization math on the CPU."""
import copy

import pytest
import torch
from torch import nn

from fasttrain.inference.quant import (
    Fp8Linear, Int8Linear, quantize_linears, scaled_mm_works, sensitive_layers)

FP8_OK = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
MODULES = {"fp8": Fp8Linear, "int8": Int8Linear}


def _pair(mode, lin):
    """The layer on its CUDA kernel and a copy on the reference path."""
    m = MODULES[mode].from_linear(lin)
    ref = copy.deepcopy(m)
    ref.backend = "reference"
    return m, ref


def _close(got, want, mode):
    """int8: the same integer sums (exact in fp32 while K·127² < 2²⁴, so at K = 768) and the
    same fp32 epilogue: equal up to one rounding of the output dtype. fp8: the kernel writes
    bf16 (before any cast) and, with fast_accum, sums in reduced precision: 2⁻⁷ of the
    output's scale."""
    if mode == "int8":
        rel = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-6}[got.dtype]
        atol = 1e-3 * rel * want.float().abs().max().item()
    else:
        rel = 2 ** -7
        atol = rel * want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 197, 768), (5, 768), (1, 768), (3, 33, 768)])
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_kernel_matches_the_reference_path(mode, dtype, shape, bias):
    if mode == "fp8" and not FP8_OK:
        pytest.skip("float8 matmuls need compute capability 8.9+")
    torch.manual_seed(0)
    lin = nn.Linear(768, 2304, bias=bias, device="cuda", dtype=dtype)
    m, ref = _pair(mode, lin)
    assert m.backend == m.kernel, f"{mode} fell back to the reference path on this GPU"
    x = torch.randn(shape, device="cuda", dtype=dtype)
    with torch.inference_mode():
        got, want = m(x), ref(x)
    assert got.shape == (*shape[:-1], 2304) and got.dtype == dtype
    _close(got, want, mode)


@pytest.mark.gpu
def test_fp8_exact_accumulation_and_native_output_dtypes():
    """Without fast accumulation the kernel differs from the reference by its bf16/fp16 output
    rounding only; and what the build's row-wise kernel writes natively (fp16 may fall back to
    bf16 + cast, which is correct but an extra pass: worth knowing for the benchmark)."""
    if not FP8_OK:
        pytest.skip("float8 matmuls need compute capability 8.9+")
    assert scaled_mm_works(str(torch.device("cuda", torch.cuda.current_device())),
                           torch.bfloat16)
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        lin = nn.Linear(3072, 768, device="cuda", dtype=dtype)
        m, ref = _pair("fp8", lin)
        m.fast_accum = False
        x = torch.randn(64, 197, 3072, device="cuda", dtype=dtype)
        with torch.inference_mode():
            got, want = m(x), ref(x)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -8,
                                   atol=2 ** -8 * want.float().abs().max().item())
        print(f"{dtype}: _scaled_mm writes {m.native_out} natively")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_compiled_max_autotune_matches_eager(mode):
    """A ViT-B MLP + projection, quantized, compiled with max-autotune (no CUDA graphs),
    fullgraph: inductor fuses the per-token quantization around the 8-bit GEMMs; within a
    quantization step of eager (a code can round the other way under fused math)."""
    if mode == "fp8" and not FP8_OK:
        pytest.skip("float8 matmuls need compute capability 8.9+")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(768, 3072), nn.GELU(), nn.Linear(3072, 768),
                          nn.Linear(768, 2304)).to("cuda", torch.bfloat16).eval()
    report = quantize_linears(model, mode)
    assert report.summary()["quantized"] == 3
    x = torch.randn(64, 197, 768, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="max-autotune-no-cudagraphs", fullgraph=True)
    with torch.inference_mode():
        want, got = model(x), compiled(x)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -5, atol=2 ** -5 * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_quantized_on_cpu_then_moved_to_cuda_picks_the_kernel(mode):
    """``.cuda()`` after quantizing on the CPU moves the codes and scales (keeping their
    dtypes) and probes the GPU's kernel; ``sensitive_layers`` keeps fc2 and the head."""
    if mode == "fp8" and not FP8_OK:
        pytest.skip("float8 matmuls need compute capability 8.9+")
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.fc1, model.mlp.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)
    model.head = nn.Linear(64, 16)
    report = quantize_linears(model, mode, keep=sensitive_layers(model))
    assert report.quantized == ["mlp.fc1"] and set(report.kept) == {"mlp.fc2", "head"}
    assert model.mlp.fc1.backend == ("reference" if mode == "fp8" else "int_mm")
    model.cuda().half()
    fc1 = model.mlp.fc1
    assert fc1.backend == fc1.kernel and fc1.qweight.is_cuda
    assert fc1.weight_scale.dtype == torch.float32 and fc1.bias.dtype == torch.float16
    with torch.inference_mode():
        y = model.head(model.mlp.fc2(torch.relu(fc1(torch.randn(40, 64, device="cuda").half()))))
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
