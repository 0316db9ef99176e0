"""``kernels/gemm_epilogue.py``'s linear with bias and GELU in the GEMM, and the MLP switch that
uses it (``layers.mlp.use_gelu_epilogue``), on the CPU: values against ``F.gelu(F.linear)``
(torch's CPU path uses the erf GELU; CUDA's epilogue is the tanh one:
test_gemm_epilogue_gpu.py),
shapes, the forward-only rule, the report, bad input."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fasttrain.kernels.gemm_epilogue import linear_gelu
from fasttrain.layers.mlp import GeluSequential, Mlp, use_gelu_epilogue


@pytest.mark.parametrize("shape", [(5, 32), (2, 7, 32), (1, 1, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gelu_matches_linear_then_gelu(shape, dtype):
    torch.manual_seed(0)
    x, w, b = torch.randn(shape, dtype=dtype), torch.randn(48, 32, dtype=dtype), \
        torch.randn(48, dtype=dtype)
    y = linear_gelu(x, w, b)
    assert y.shape == (*shape[:-1], 48) and y.dtype == dtype
    want = F.gelu(F.linear(x.float(), w.float(), b.float()))
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("bad, match", [
    (lambda x, w, b: (x, w, None), "an \\(N,\\) bias"),
    (lambda x, w, b: (x, w, b[:-1]), "an \\(N,\\) bias"),
    (lambda x, w, b: (x[..., :-1], w, b), "does not fit"),
    (lambda x, w, b: (x.double(), w, b), "does not fit"),
])
def test_linear_gelu_refuses_what_does_not_fit_in_one_line(bad, match):
    args = bad(torch.randn(3, 8), torch.randn(4, 8), torch.randn(4))
    with pytest.raises(ValueError, match=match) as err:
        linear_gelu(*args)
    assert "\n" not in str(err.value)


def _mlps():
    torch.manual_seed(0)
    model = nn.Sequential(Mlp(32, 64), Mlp(32, 64), Mlp(32, 64, bias=False))
    model[1].fc1 = nn.Sequential(model[1].fc1)  # wrapped by another library: not a plain linear
    return model


def test_the_switch_fuses_plain_fc1_and_reports_the_rest():
    model = _mlps()
    lines = use_gelu_epilogue(model)
    assert [m.gelu_epilogue for m in model] == [True, False, False]
    assert lines == ["fc1 bias + GELU (tanh) in the GEMM epilogue ×1",
                     "2 kept their path (fc1 quantized, wrapped or without a bias)"]
    assert use_gelu_epilogue(nn.Linear(4, 4)) == [
        "no fasttrain MLP to fuse (convert the model first)"]


def test_the_epilogue_runs_without_gradients_only(monkeypatch):
    """Forward only: under no_grad the MLP calls the epilogue GEMM; with gradients (training)
    it keeps its path, whatever the switch says."""
    import fasttrain.kernels.gemm_epilogue as ge

    model, x = _mlps()[0], torch.randn(2, 5, 32)
    with torch.no_grad():
        want = model(x)
    use_gelu_epilogue(model)
    calls = []
    monkeypatch.setattr(ge, "linear_gelu", lambda *a: calls.append(1) or linear_gelu(*a))
    with torch.no_grad():
        got = model(x)
    assert calls == [1]
    torch.testing.assert_close(got, want)  # the CPU's erf GELU: the same function
    model(x).sum().backward()
    assert calls == [1] and model.fc1.weight.grad is not None


def test_a_plain_sequential_mlp_takes_the_epilogue_for_each_pair(monkeypatch):
    """A converted ``nn.Sequential`` MLP of your own (GeluSequential): each Linear → GELU pair
    runs in the epilogue without gradients, the same values as the Sequential; with
    gradients its own path."""
    import fasttrain.kernels.gemm_epilogue as ge

    torch.manual_seed(0)
    mods = (nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 8))
    plain = nn.Sequential(*mods)
    seq = GeluSequential(*mods)
    seq.fused = False
    assert use_gelu_epilogue(seq) == ["fc1 bias + GELU (tanh) in the GEMM epilogue ×2"]
    calls = []
    monkeypatch.setattr(ge, "linear_gelu", lambda *a: calls.append(1) or linear_gelu(*a))
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(seq(x), plain(x))  # the CPU's erf GELU: the same function
    assert calls == [1, 1]
    seq(x).sum().backward()
    assert calls == [1, 1] and mods[0].weight.grad is not None


def test_a_sequential_pair_that_does_not_fit_keeps_the_fused_path(monkeypatch):
    """Fused and epilogue both on: the plain pair takes the epilogue; the pair whose linear has
    no bias (which the epilogue needs) takes the bias + GELU kernel; the report counts both."""
    import fasttrain.kernels.activations as act
    import fasttrain.kernels.gemm_epilogue as ge

    torch.manual_seed(0)
    mods = (nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16, bias=False), nn.GELU())
    plain = nn.Sequential(*mods)
    seq = GeluSequential(*mods)
    seq.fused = True
    assert use_gelu_epilogue(seq) == ["fc1 bias + GELU (tanh) in the GEMM epilogue ×1",
                                      "1 kept their path (fc1 quantized, wrapped or without a "
                                      "bias)"]
    epi, kernel = [], []
    monkeypatch.setattr(ge, "linear_gelu", lambda *a: epi.append(1) or linear_gelu(*a))
    monkeypatch.setattr(act, "bias_gelu", lambda *a: kernel.append(1) or
                        act.bias_gelu_reference(*a))
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(seq(x), plain(x))
    assert epi == [1] and kernel == [1]


def test_autocast_keeps_the_mlp_path(monkeypatch):
    """Under autocast (fp32 weights, a bf16 input to fc1) the epilogue GEMM, which takes one
    dtype, is not called: the MLP computes what autocast always gave it."""
    import fasttrain.kernels.gemm_epilogue as ge

    model = _mlps()[0]
    use_gelu_epilogue(model)
    monkeypatch.setattr(ge, "linear_gelu", lambda *a: pytest.fail("epilogue called"))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(torch.randn(2, 32)).dtype == torch.bfloat16


def test_the_epilogue_mlp_compiles_in_one_graph():
    """Inductor takes ``_addmm_activation`` as an extern call and the checks on grad mode,
    autocast and dtype as guards: one graph, the eager values."""
    model = Mlp(32, 64).eval()
    use_gelu_epilogue(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


def test_a_bias_of_another_dtype_keeps_the_mlp_path(monkeypatch):
    """bf16 master weights leave the biases in fp32: the epilogue GEMM, which takes one dtype,
    is not called; the MLP's own path runs."""
    import fasttrain.kernels.gemm_epilogue as ge

    import fasttrain.kernels.activations as act

    model = Mlp(32, 64).to(torch.bfloat16)
    model.fc1.bias.data = model.fc1.bias.data.float()
    model.fused = True  # the bias + GELU kernel adds an fp32 bias (its reference, on the CPU)
    use_gelu_epilogue(model)
    monkeypatch.setattr(ge, "linear_gelu", lambda *a: pytest.fail("epilogue called"))
    monkeypatch.setattr(act, "bias_gelu", act.bias_gelu_reference)
    with torch.no_grad():
        assert model(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16
