"""fasttrain's fused paths for a plain PyTorch model (CPU; the Triton kernels interpreted): the
torch.nn converters (LayerNorm, RMSNorm, Linear → GELU Sequentials, MultiheadAttention) give
the original module's output and every gradient, plain and fused, in fp32 and bf16, keep the
state dict and the parameter objects, refuse what their layers do not compute with the reason;
the SDPA route gives SDPA's output and gradients where it takes a call, SDPA's own elsewhere,
counts both, restores SDPA on exit and traces under torch.compile; tiny nanoGPT-, ViT- and
nn.TransformerEncoder-style models converted with every kernel on train as the originals do."""
from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")

from tests.interpreted import interpret, kernels_interpreted  # noqa: E402,F401  (fixture)

with kernels_interpreted():
    import fasttrain.kernels.activations  # noqa: F401
    import fasttrain.kernels.norms  # noqa: F401
    import fasttrain.kernels.seq_attention  # noqa: F401

import fasttrain.layers.attention  # noqa: E402
from fasttrain.converters import convert, convertible, registry  # noqa: E402
from fasttrain.layers import sdpa_route  # noqa: E402
from fasttrain.layers.attention import MultiheadSelfAttention  # noqa: E402
from fasttrain.layers.fused import fused_layers, switch_fused  # noqa: E402
from fasttrain.layers.mlp import GeluSequential  # noqa: E402
from fasttrain.layers.norm import LayerNorm, RMSNorm  # noqa: E402
from fasttrain.layers.sdpa_route import SdpaRoute  # noqa: E402
from fasttrain.recipe import KERNEL_FAMILIES, Recipe  # noqa: E402
from fasttrain.techniques import kernels as kernels_tech  # noqa: E402
from fasttrain.techniques.base import TrainState  # noqa: E402

from tests.converters.plain_models import (PackedAttention, TinyEncoder, TinyGPT,  # noqa: E402
                                           TinyViT, packed_qkv, randomise)

PLAIN_REL, FUSED_REL, BF16_REL = 1e-6, 1e-4, 2e-2
ALL = frozenset(KERNEL_FAMILIES)
SDPA = torch._C._nn.scaled_dot_product_attention


# ----------------------------------------------------------------------------- helpers

def converted(module: nn.Module, fused: bool) -> tuple[nn.Module, object]:
    """A converted copy (and the report), with every fused path on where ``fused``."""
    twin = copy.deepcopy(module)
    report = convert(twin)
    if fused:
        switch_fused(fused_layers(twin), ALL, torch.device("cpu"))
    return twin, report


def forward_backward(module: nn.Module, *inputs: torch.Tensor, seed: int = 0, **kwargs):
    """[output, each input's gradient, each parameter's gradient] for one random cotangent."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    for p in module.parameters():
        p.grad = None
    out = module(*inputs, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out.float() * cot).sum().backward()
    return [out.detach()] + [t.grad for t in inputs] + [p.grad for p in module.parameters()]


def assert_same(got: list, want: list, rel: float) -> None:
    """Each tensor within ``rel`` of the largest magnitude of its reference (at least 1)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, i
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, w.shape, g.dtype, w.dtype)
        g, w = g.detach().float(), w.detach().float()
        scale = max(float(w.abs().max()), 1.0)
        diff = float((g - w).abs().max())
        assert diff <= rel * scale, f"tensor {i}: {diff:.3g} > {rel * scale:.3g}"


def check_module(module: nn.Module, *inputs: torch.Tensor, dtype=torch.float32, **kwargs):
    """Plain and fused converted copies against the original, in ``dtype``. The plain path is
    torch's own computation; the fused one in bf16 rounds elsewhere (fp32 inside the kernels,
    and Triton's interpreter truncates to bf16 where a kernel stores without ``rounded``: bias
    + GELU), so there it must be about as close to the fp32 result (of the same bf16 weights
    and inputs) as torch's bf16 result is: no more than 3 times as far, plus 1% of the largest
    magnitude."""
    module = module.to(dtype)
    inputs = tuple(t.to(dtype) for t in inputs)
    want = forward_backward(module, *inputs, **kwargs)
    exact = None
    if dtype != torch.float32:
        exact = forward_backward(copy.deepcopy(module).float(), *(t.float() for t in inputs),
                                 **kwargs)
    for fused in (False, True):
        twin, report = converted(module, fused)
        assert report and not report.skipped, report.skipped_lines()
        got = forward_backward(twin, *inputs, **kwargs)
        if exact is None or not fused:
            assert_same(got, want, FUSED_REL if fused else PLAIN_REL)
        else:
            assert_as_close_as(got, want, exact)
    return twin


def assert_as_close_as(got: list, want: list, exact: list) -> None:
    """Each of ``got`` (``want``'s dtypes and shapes) within 3 times ``want``'s distance from
    ``exact`` plus 1%, relative to exact's largest magnitude (at least 1)."""
    for i, (g, w, e) in enumerate(zip(got, want, exact, strict=True)):
        if w is None:
            assert g is None, i
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, w.shape, g.dtype, w.dtype)
        e = e.detach().float()
        scale = max(float(e.abs().max()), 1.0)
        ours, torchs = (float((t.detach().float() - e).abs().max()) / scale for t in (g, w))
        assert ours <= 3 * torchs + 1e-2, f"tensor {i}: {ours:.3g} against torch's {torchs:.3g}"


DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _seed():
    """The same random inputs whatever ran before in the process (xdist's order varies)."""
    torch.manual_seed(0)


# ----------------------------------------------------------------------------- norms

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_torch(dtype, bias):
    norm = randomise(nn.LayerNorm(37, eps=1e-6, bias=bias))
    twin = check_module(norm, torch.randn(3, 5, 37), dtype=dtype)
    assert type(twin) is LayerNorm and twin.fused and not twin.feeds_matmul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [None, 1e-5])
def test_rms_norm_matches_torch(dtype, eps):
    norm = randomise(nn.RMSNorm(37, eps=eps))
    twin = check_module(norm, torch.randn(2, 7, 37) * 3, dtype=dtype)
    assert type(twin) is RMSNorm and twin.fused and twin.eps == eps


def test_fused_norms_keep_the_dtype_autocast_gives():
    """Under (CPU) autocast the fused norms give what nn.LayerNorm and nn.RMSNorm give."""
    x = torch.randn(4, 24)
    for norm in (randomise(nn.LayerNorm(24)), randomise(nn.RMSNorm(24))):
        twin, _ = converted(norm, fused=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = norm(x.bfloat16()), twin(x.bfloat16())
        assert got.dtype == torch.float32 or got.dtype == want.dtype
        assert_same([got.float()], [want.float()], BF16_REL)


# ----------------------------------------------------------------------------- Sequential MLP

SEQUENTIALS = {
    "mlp": lambda: nn.Sequential(nn.Linear(20, 37), nn.GELU(), nn.Linear(37, 20)),
    "tanh-no-bias": lambda: nn.Sequential(nn.Linear(20, 37, bias=False),
                                          nn.GELU(approximate="tanh"), nn.Linear(37, 20)),
    "norm-two-pairs-dropout": lambda: nn.Sequential(
        nn.LayerNorm(20), nn.Linear(20, 24), nn.GELU(), nn.Dropout(0.0), nn.Linear(24, 33),
        nn.GELU(approximate="tanh"), nn.Linear(33, 20)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SEQUENTIALS)
def test_linear_gelu_sequential_matches_torch(name, dtype):
    seq = randomise(SEQUENTIALS[name]())
    twin = check_module(seq, torch.randn(3, 5, 20), dtype=dtype)
    assert type(twin) is GeluSequential and twin.fused
    assert len(twin) == len(seq) and all(isinstance(a, type(b)) for a, b in zip(twin, seq))
    assert twin.fp32_params() == [m.bias for i, m in enumerate(twin)
                                  if isinstance(m, nn.Linear) and i + 1 < len(twin)
                                  and isinstance(twin[i + 1], nn.GELU) and m.bias is not None]


def test_sequential_of_2d_inputs_and_slices():
    seq = randomise(SEQUENTIALS["mlp"]())
    check_module(seq, torch.randn(11, 20))
    twin, _ = converted(seq, fused=True)
    assert type(twin[0:2]) is GeluSequential  # nn.Sequential's own slicing keeps the class


def test_sequential_without_a_pair_is_passed_over():
    """No Linear → GELU pair: not the converter's, and not reported as skipped."""
    for seq in (nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)),
                nn.Sequential(nn.GELU(), nn.Linear(4, 4)), nn.Sequential()):
        report = convert(seq)
        assert not report and not report.skipped and type(seq) is nn.Sequential
        assert not convertible(seq)


# ----------------------------------------------------------------------------- MultiheadAttention

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_first,bias", [(True, True), (False, True), (True, False)])
def test_multihead_self_attention_matches_torch(batch_first, bias, dtype):
    mha = randomise(nn.MultiheadAttention(24, 3, bias=bias, batch_first=batch_first))
    x = torch.randn(2, 11, 24) if batch_first else torch.randn(11, 2, 24)
    call = lambda m: (lambda t: m(t, t, t, need_weights=False))  # noqa: E731
    twin = check_module(SimpleModule(mha, call), x, dtype=dtype)
    assert type(twin.inner) is MultiheadSelfAttention and twin.inner.fused


class SimpleModule(nn.Module):
    """``call(module)(x)`` as a module (its parameters: the wrapped module's)."""

    def __init__(self, module: nn.Module, call):
        super().__init__()
        self.inner, self.call = module, call

    def forward(self, x):
        return self.call(self.inner)(x)


def test_multihead_attention_other_calls_run_torch_forward(monkeypatch):
    """Weights asked for, a mask, causal, separate key/value, unbatched input, too many
    tokens: the fused layer runs nn.MultiheadAttention's own forward (bitwise its result)."""
    mha = randomise(nn.MultiheadAttention(16, 2, batch_first=True))
    twin, _ = converted(mha, fused=True)
    monkeypatch.setattr(fasttrain.kernels.seq_attention, "projected_seq_attention",
                        lambda *a, **k: pytest.fail("the fused path ran"))
    x, y = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    calls = [((x, x, x), {}), ((x, x, x), {"need_weights": False, "attn_mask": mask}),
             ((x, x, x), {"need_weights": False, "attn_mask": mask, "is_causal": True}),
             ((x, y, y), {"need_weights": False}), ((x[0], x[0], x[0]), {"need_weights": False}),
             ((x, x, x), {"need_weights": False,
                          "key_padding_mask": torch.zeros(2, 6, dtype=torch.bool)})]
    for args, kwargs in calls:
        got, want = twin(*args, **kwargs), mha(*args, **kwargs)
        assert torch.equal(got[0], want[0])
        assert (got[1] is None) == (want[1] is None)
    monkeypatch.setattr(fasttrain.layers.attention, "SEQ_ATTENTION_MAX_TOKENS", 5)
    assert torch.equal(twin(x, x, x, need_weights=False)[0], mha(x, x, x, need_weights=False)[0])


# ----------------------------------------------------------------- state dicts, refusals

class Everything(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.rms = nn.RMSNorm(16, eps=1e-6)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.rms(x))


# ----------------------------------------------------------------------------- patch projection

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_patch_projection_matches_torch(dtype, bias):
    """Output and gradients of the image, weight and bias; an image that does not tile (the
    convolution leaves its last rows and columns out) and an unbatched one."""
    conv = randomise(nn.Conv2d(3, 12, 4, stride=4, bias=bias))
    twin = check_module(conv, torch.randn(2, 3, 18, 23), dtype=dtype)
    assert type(twin).__name__ == "PatchEmbed" and twin.as_gemm
    x = torch.randn(3, 18, 23, dtype=dtype)  # unbatched, and not tiling
    assert_same([twin(x)], [conv(x)], FUSED_REL if dtype == torch.float32 else BF16_REL)


def test_patch_projection_output_is_laid_out_as_the_convolutions():
    """Contiguous for a contiguous image (a small CNN's ``.view`` after it works), channels-last
    for a channels-last one; ``padding="valid"`` is no padding."""
    conv = randomise(nn.Conv2d(1, 16, 2, stride=2, padding="valid"))
    twin, report = converted(conv, True)
    assert report.converted == {"torch Conv2d patch projection": 1}
    x = torch.randn(4, 1, 8, 8)
    out = twin(x)
    assert out.is_contiguous() and out.view(4, -1).shape == (4, 16 * 16)
    assert_same([out], [conv(x)], FUSED_REL)
    rgb = randomise(nn.Conv2d(3, 8, 4, stride=4))
    twin, _ = converted(rgb, True)
    x = torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    out = twin(x)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_same([out], [rgb(x)], FUSED_REL)


def test_convolutions_that_are_not_patch_projections_are_passed_over():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 2, stride=2),
                          nn.Conv2d(3, 8, 4, stride=2), nn.Conv2d(3, 8, (4, 2), stride=(4, 2)))
    report = convert(model)
    assert not report and not report.skipped
    assert all(type(m) is nn.Conv2d for m in model)


def test_state_dict_round_trip_and_parameter_objects():
    model = randomise(Everything())
    before = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    twin = copy.deepcopy(model)
    report = convert(model, kernels="fused")
    assert dict(report.converted) == {"torch LayerNorm": 1, "torch RMSNorm": 1,
                                      "torch MultiheadAttention": 1,
                                      "torch Sequential Linear → GELU": 1}
    assert list(model.state_dict()) == keys
    assert all(p is before[n] for n, p in model.named_parameters())
    plain = Everything()
    plain.load_state_dict(model.state_dict())  # converted → the unconverted class
    x = torch.randn(2, 9, 16)
    assert_same([plain(x)], [twin(x)], PLAIN_REL)
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(1.5)
    model.load_state_dict(plain.state_dict())  # and back
    assert_same([model(x)], [plain(x)], FUSED_REL)


REFUSED = {  # module → the reason's words
    "layer norm over 2 dims": (lambda: nn.LayerNorm((4, 5)), "last 2 dims"),
    "layer norm, no affine": (lambda: nn.LayerNorm(8, elementwise_affine=False),
                              "no elementwise affine"),
    "rms norm, no affine": (lambda: nn.RMSNorm(8, elementwise_affine=False),
                            "no elementwise affine"),
    "float64 layer norm": (lambda: nn.LayerNorm(8).double(), "torch.float64 parameters"),
    "float64 Sequential": (lambda: nn.Sequential(nn.Linear(4, 4), nn.GELU()).double(),
                           "torch.float64 parameters"),
    "mha kdim": (lambda: nn.MultiheadAttention(8, 2, kdim=4, vdim=4), "kdim or vdim"),
    "mha bias_kv": (lambda: nn.MultiheadAttention(8, 2, add_bias_kv=True), "add_bias_kv"),
    "mha zero attn": (lambda: nn.MultiheadAttention(8, 2, add_zero_attn=True), "add_zero_attn"),
    "mha dropout": (lambda: nn.MultiheadAttention(8, 2, dropout=0.1), "dropout 0.1"),
    "padded patches": (lambda: nn.Conv2d(3, 8, 4, stride=4, padding=1), "padding (1, 1)"),
    "grouped patches": (lambda: nn.Conv2d(3, 6, 4, stride=4, groups=3), "grouped"),
    "float64 patches": (lambda: nn.Conv2d(3, 8, 4, stride=4).double(),
                        "torch.float64 parameters"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_what_the_layers_do_not_compute_is_refused_with_its_reason(name):
    make, words = REFUSED[name]
    module = make()
    cls = type(module)
    report = convert(module)
    assert not report and type(module) is cls
    lines = report.skipped_lines()
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith("torch "), lines
    assert not convertible(module)


def test_convertible():
    assert convertible(Everything()) and convertible(nn.Sequential(nn.LayerNorm(4)))
    assert not convertible(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert all(conv.name.startswith("torch ") for src, conv in registry().items()
               if src.startswith("torch.nn."))


# ----------------------------------------------------------------------------- the SDPA route

def attention_grads(x, w, heads, layout, route: SdpaRoute | None = None, **kwargs):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    q, k, v = packed_qkv(x, w, heads, layout)
    if route is None:
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    else:
        with route.active():
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out.float() * cot).sum().backward()
    return [out.detach(), x.grad, w.grad]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["vit", "gpt"])
@pytest.mark.parametrize("causal", [False, True])
def test_route_gives_sdpa_outputs_and_gradients(layout, causal, dtype):
    B, T, C, H = 2, 13, 24, 3  # head dim 8, a partial block of tokens
    x = torch.randn(B, T, C, dtype=dtype)
    w = (torch.randn(3 * C, C) * C ** -0.5).to(dtype)
    want = attention_grads(x, w, H, layout, is_causal=causal)
    route = SdpaRoute()
    got = attention_grads(x, w, H, layout, route, is_causal=causal, scale=None)
    assert_same(got, want, BF16_REL if dtype == torch.bfloat16 else FUSED_REL)
    assert dict(route.calls) == ({"causal": 1} if causal else {"routed": 1})
    assert F.scaled_dot_product_attention is SDPA
    if not causal:  # the routed output is SDPA's layout: (B, H, T, D)
        assert got[0].shape == (B, H, T, C // H)


def test_route_leaves_what_the_kernel_does_not_take_to_sdpa(monkeypatch):
    B, T, C, H = 2, 9, 16, 2
    x, w = torch.randn(B, T, C), torch.randn(3 * C, C) * 0.25
    q, k, v = packed_qkv(x, w, H, "vit")
    mask = torch.randn(T, T)
    calls = {
        "a mask": ((q, k, v), {"attn_mask": mask}),
        "dropout": ((q, k, v), {"dropout_p": 0.5}),
        "q, k and v are not slices": ((q.contiguous(), k.contiguous(), v.contiguous()), {}),
        "not slices (another order)": ((k, q, v), {}),
        "a dtype": ((q.double(), k.double(), v.double()), {}),
        "not (B, H, T, D)": ((q[0], k[0], v[0]), {}),
        "cross": ((q, k[:, :, :5], v[:, :, :5]), {}),
    }
    route = SdpaRoute()
    for name, (args, kwargs) in calls.items():
        torch.manual_seed(0)
        want = SDPA(*args, **kwargs)
        with route.active():
            torch.manual_seed(0)
            got = F.scaled_dot_product_attention(*args, **kwargs)
        assert torch.equal(got, want), name
    reasons = {why for why in route.calls}
    assert "routed" not in reasons and "a mask" in reasons and "dropout" in reasons
    assert sum(route.calls.values()) == len(calls)
    assert sum(n for why, n in route.calls.items() if "not slices" in why) == 2
    monkeypatch.setattr(sdpa_route, "SEQ_ATTENTION_MAX_TOKENS", 8)
    with route.active():
        F.scaled_dot_product_attention(q, k, v)
    assert any("over 8 tokens" in why for why in route.calls)
    assert "to SDPA (a mask ×1" in route.summary()


def test_route_restores_sdpa_after_an_error_and_nests():
    outer, inner = SdpaRoute(), SdpaRoute()
    with pytest.raises(RuntimeError, match="boom"):
        with outer.active():
            with inner.active():
                assert F.scaled_dot_product_attention is sdpa_route.routed_sdpa
                raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is SDPA and not sdpa_route._ACTIVE


def test_the_ops_behind_the_route():
    """``seq_attention_qkv`` (the compiled route's op) gives SDPA's output and q's, k's and v's
    gradients whether q, k and v are packed views or separate tensors;
    ``seq_attention_of_views`` (the eager route's) refuses views it would not read."""
    from fasttrain.kernels.seq_attention import seq_attention_of_views, seq_attention_qkv

    x, w = torch.randn(2, 10, 16), torch.randn(48, 16) * 0.25
    for packed in (True, False):
        q, k, v = (t.detach().clone() for t in packed_qkv(x, w, 2, "vit"))
        if not packed:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        leaves = [t.requires_grad_() for t in (q, k, v)]
        grads = []
        for attend in (seq_attention_qkv, SDPA):
            out = attend(*leaves, scale=0.3)
            grads.append([out.detach(), *torch.autograd.grad(out.square().sum(), leaves)])
        assert_same(grads[0], grads[1], FUSED_REL)
    q, k, v = packed_qkv(x, w, 2, "gpt")
    with pytest.raises(ValueError, match="start at"):
        seq_attention_of_views(q._base, k, q, v)


@pytest.mark.parametrize("layout", ["vit", "gpt"])
def test_route_under_torch_compile(layout):
    """Dynamo traces the router: one graph, no recompile over steps, SDPA's results; the
    call is counted once, when traced; a causal call is traced to SDPA."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    for causal in (False, True):
        model = randomise(PackedAttention(causal=causal, layout=layout))
        x = torch.randn(2, 11, 24)
        want = forward_backward(model, x)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        route = SdpaRoute()
        graphs = counters["stats"]["unique_graphs"]
        for _ in range(3):
            with route.active():
                got = forward_backward(compiled, x)
            assert_same(got, want, FUSED_REL)
        assert counters["stats"]["unique_graphs"] == graphs + 1
        assert dict(route.calls) == ({"causal": 1} if causal else {"routed": 1})
    torch._dynamo.reset()


def test_route_under_torch_compile_with_q_k_v_as_graph_inputs():
    """A compiled function handed q, k and v: the op finds them packed (or not: a swapped
    order gives a packed copy) when it runs; the results are SDPA's either way."""
    torch._dynamo.reset()
    attend = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                           backend="aot_eager", fullgraph=True)
    x, w = torch.randn(2, 9, 16), torch.randn(48, 16) * 0.25
    q, k, v = packed_qkv(x, w, 2, "gpt")
    route = SdpaRoute()
    with route.active():
        assert_same([attend(q, k, v)], [SDPA(q, k, v)], FUSED_REL)
        assert_same([attend(k, q, v)], [SDPA(k, q, v)], FUSED_REL)
    assert route.calls["routed"] >= 1
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- tiny models

def batches(name: str, n: int = 3):
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        if name == "gpt":
            ids = torch.randint(0, 50, (3, 12), generator=gen)
            yield ids, lambda m, ids=ids: F.cross_entropy(
                m(ids)[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
        elif name == "vit":
            img, y = torch.randn(4, 3, 16, 16, generator=gen), torch.randint(0, 5, (4,),
                                                                             generator=gen)
            yield img, lambda m, img=img, y=y: F.cross_entropy(m(img), y)
        else:
            ids, y = torch.randint(0, 40, (4, 10), generator=gen), torch.randint(0, 5, (4,),
                                                                                 generator=gen)
            yield ids, lambda m, ids=ids, y=y: F.cross_entropy(m(ids), y)


MODELS = {"gpt": TinyGPT, "vit": TinyViT, "encoder": TinyEncoder}
EXPECTED = {
    "gpt": {"your pre-norm block": 2, "torch LayerNorm": 1, "torch Sequential Linear → GELU": 2},
    "vit": {"your pre-norm block": 2, "torch LayerNorm": 1, "torch Sequential Linear → GELU": 2,
            "torch Conv2d patch projection": 1},
    "encoder": {"torch LayerNorm": 4, "torch MultiheadAttention": 2},
}


def losses(model: nn.Module, name: str, route: SdpaRoute | None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    out = []
    for _, loss_of in batches(name):
        opt.zero_grad(set_to_none=True)
        if route is None:
            loss = loss_of(model)
        else:
            with route.active():
                loss = loss_of(model)
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


@pytest.mark.parametrize("name", MODELS)
def test_tiny_plain_models_converted_train_as_the_originals(name):
    """Converted, every kernel on (the SDPA route too): the same losses over AdamW steps, and
    the parameters the optimizer holds are the model's own."""
    torch.manual_seed(0)
    model = randomise(MODELS[name]())
    twin = copy.deepcopy(model)
    report = convert(twin, kernels="fused")
    assert dict(report.converted) == EXPECTED[name] and not report.skipped, report.summary()
    assert report.kernels and report.kernels_kept is None
    route = SdpaRoute()
    got, want = losses(twin, name, route), losses(model, name, None)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    if name == "vit":
        assert dict(route.calls) == {"routed": 2 * 3}  # two blocks, three steps
    elif name == "gpt":
        assert dict(route.calls) == {"causal": 2 * 3}
    else:
        assert not route.calls  # nn.MultiheadAttention's fused path calls no SDPA
    # AdamW moves a weight by about lr a step whatever its gradient's size: where that is
    # rounding noise (the keys' bias, which softmax ignores) the two runs may step opposite
    # ways, so the weights agree to 2·lr a step (4.5e-3 seen here)
    drift = max(float((p - q).abs().max()) for p, q in zip(twin.parameters(), model.parameters()))
    assert drift <= 2 * 1e-3 * 3


# ----------------------------------------------------------------------------- the kernels switch

def kernels_state(model: nn.Module, kernels: str) -> TrainState:
    wl = SimpleNamespace(name="plain", converts=False)
    return TrainState(recipe=Recipe(kernels=kernels), workload=wl, device=torch.device("cpu"),
                      model=model, trainable=model, micro_batch=2)


def test_kernels_switch_routes_sdpa_and_reports_it():
    model = randomise(TinyViT())
    convert(model)
    state = kernels_state(model, "fused")
    line = kernels_tech.apply(state)
    assert "bias + GELU in one Triton kernel ×2" in line and "scaled_dot" not in line
    assert len(state.step_contexts) == 1 and not state.warnings, state.warnings
    with state.step_context():
        model(torch.randn(2, 3, 16, 16)).sum().backward()
    assert F.scaled_dot_product_attention is SDPA
    state.applied["kernels"] = line  # as apply_all records it
    kernels_tech.finish(state)
    assert state.applied["kernels"].endswith(
        "F.scaled_dot_product_attention: 2 calls to the Triton self-attention kernel")
    assert "kernels" not in state.no_effect
    assert state.applied["attention"].endswith("2 calls to the Triton self-attention kernel")


def test_kernels_switch_without_routed_calls_or_layers_has_no_effect():
    """kernels=attention on nanoGPT-style causal attention: the route is tried, routes
    nothing; no other fused path is on: no effect, with the reason."""
    model = TinyGPT()
    state = kernels_state(model, "attention")
    assert kernels_tech.apply(state) is None and len(state.step_contexts) == 1
    assert not state.warnings and not state.no_effect  # the route may yet take a call
    with state.step_context():
        model(torch.randint(0, 50, (2, 12)))
    kernels_tech.finish(state)
    assert "0 calls to the Triton self-attention kernel, 2 to SDPA (causal ×2)" in \
        state.no_effect["kernels"]
    assert "kernels" not in state.applied


def test_kernels_switch_leaves_a_fasttrain_attention_layer_to_itself():
    model = Everything()
    convert(model)
    state = kernels_state(model, "attention")
    assert "multi-head self-attention" in kernels_tech.apply(state)
    assert not state.step_contexts  # a fasttrain attention layer: no route
    assert math.isfinite(float(model(torch.randn(2, 4, 16)).sum()))


class Images(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        gen = torch.Generator().manual_seed(i)
        return {"images": torch.randn(3, 16, 16, generator=gen),
                "y": torch.randint(0, 5, (), generator=gen)}


def test_a_plain_vit_workload_with_convert_and_kernels_trains_as_without():
    """``fasttrain train`` of a plain-PyTorch ViT: convert=true finds its LayerNorms and MLPs,
    kernels=fused switches them and routes its SDPA calls, eager and compiled: the losses of
    the plain run, and the run says what it did."""
    from fasttrain import SimpleWorkload
    from fasttrain.run.loop import train

    wl = SimpleWorkload(name="tiny-vit", build=lambda: randomise(TinyViT()), data=Images,
                        loss_fn=lambda m, b: F.cross_entropy(m(b["images"]), b["y"],
                                                             reduction="sum"),
                        default_batch=4)
    plain = train(wl, Recipe(), steps=2, warmup=1, device="cpu")
    for extra, traced in (({}, 6), ({"compile": "model", "compile_backend": "aot_eager"}, 2)):
        res = train(wl, Recipe(convert=True, kernels="fused", **extra), steps=2, warmup=1,
                    device="cpu")
        assert res.losses == pytest.approx(plain.losses, rel=1e-4)
        assert res.applied["convert"] == (
            "torch Conv2d patch projection ×1; your pre-norm block ×2; "
            "torch Sequential Linear → GELU ×2; torch LayerNorm ×1")
        assert res.applied["kernels"].endswith(
            f"F.scaled_dot_product_attention: {traced} calls to the Triton self-attention kernel")
        assert not res.warnings and not res.no_effect, (res.warnings, res.no_effect)
    torch._dynamo.reset()
