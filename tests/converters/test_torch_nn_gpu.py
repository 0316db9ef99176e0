"""torch.nn's converters and the SDPA route on CUDA (marker ``gpu``; skipped without a GPU): a
plain-PyTorch ViT and nn.TransformerEncoder, converted with every fused path as compiled Triton
kernels, keep the unconverted model's loss and gradients under bf16 autocast, eager and under
torch.compile (Inductor); compiled, the route's op finds q, k and v packed in the projection's
output and reads them in place."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from tests.converters.plain_models import TinyEncoder, TinyViT, randomise

pytestmark = pytest.mark.gpu


def _assert_close_rel(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=rel,
                               atol=rel * max(want.abs().max().item(), 1e-6))


def _loss(model, name: str):
    gen = torch.Generator(device="cuda").manual_seed(0)
    if name == "vit":
        x = torch.randn(8, 3, 16, 16, device="cuda", generator=gen)
    else:
        x = torch.randint(0, 40, (8, 10), device="cuda", generator=gen)
    y = torch.randint(0, 5, (8,), device="cuda", generator=gen)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name", ["vit", "encoder"])
def test_plain_models_converted_keep_loss_and_gradients(name, compiled, monkeypatch):
    import fasttrain
    from fasttrain.kernels import seq_attention
    from fasttrain.layers.sdpa_route import SdpaRoute

    packed = []  # the compiled route's op, when it runs: did it read q, k and v in place?
    real = seq_attention._packed

    def recorded(q, k, v):
        out = real(q, k, v)
        if q.device.type == "cuda" and not isinstance(q, FakeTensor):
            packed.append(out.data_ptr() == q.data_ptr())
        return out
    monkeypatch.setattr(seq_attention, "_packed", recorded)
    torch._dynamo.reset()
    torch.manual_seed(0)
    original = randomise({"vit": TinyViT, "encoder": TinyEncoder}[name]()).cuda()
    converted = copy.deepcopy(original)
    report = fasttrain.convert(converted, kernels="fused")
    assert report and report.kernels and report.kernels_kept is None, report.summary()
    route = SdpaRoute()
    run = torch.compile(converted) if compiled else converted
    with route.active():
        got = _loss(run, name)
    got.backward()
    want = _loss(original, name)
    want.backward()
    _assert_close_rel(got.detach(), want.detach(), 2e-2)
    for (n, a), b in zip(original.named_parameters(), converted.parameters()):
        _assert_close_rel(b.grad, a.grad, 5e-2)
    if name == "vit":
        assert dict(route.calls) == {"routed": 2}  # two blocks: called, or traced, once each
        assert packed == ([True] * 4 if compiled else [])  # each block forward and backward
    torch._dynamo.reset()
