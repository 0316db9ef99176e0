"""The last block on the class token alone (inference/head_tokens.py): which models it marks
and why others keep every token, the logits unchanged, and the attention of the first queries
against the whole layer's (layers/attention.py ``first_queries``)."""
import pytest
import torch
from torch import nn

from fasttrain.converters.apply import convert
from fasttrain.errors import FasttrainError
from fasttrain.inference.head_tokens import keep_head_tokens
from fasttrain.inference.spec import InferRung
from fasttrain.layers.attention import SelfAttention
from fasttrain.workloads.vit import CONFIGS, ViT
from tests.converters.timm_stub import import_timm

TIMM = import_timm()
needs_timm = pytest.mark.skipif(TIMM is None, reason="timm is not installed")


def _images(n=3):
    return torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kernels", ["none", "fused"])
def test_fasttrains_vit_gives_the_same_logits_from_the_class_token_alone(kernels):
    torch.manual_seed(0)
    vit = ViT(CONFIGS["tiny"]).eval()
    convert(vit, kernels=kernels)
    with torch.inference_mode():
        want = vit.head(vit.features(_images()))
        got_report = keep_head_tokens(vit)
        got = vit.head(vit.features(_images()))
    assert got_report == {"blocks": 1, "line": "the last of 2 blocks computes the class token "
                          "alone (the head reads nothing else)"}
    assert vit.blocks[-1].head_rows == 1 and not getattr(vit.blocks[0], "head_rows", 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_timm
def test_timms_vit_gives_the_same_logits_from_the_class_token_alone():
    torch.manual_seed(0)
    m = TIMM.create_model("vit_tiny_patch16_224", num_classes=10, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        want = m(x)
        assert keep_head_tokens(m)["line"].startswith("every token kept: its blocks are not")
        convert(m, kernels="none")
        assert keep_head_tokens(m)["blocks"] == 1
        got = m(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_timm
@pytest.mark.parametrize("kwargs, why", [
    (dict(global_pool="avg"), "its head pools the tokens ('avg')"),
    (dict(global_pool="map"), "its head pools the tokens by attention")])
def test_timm_heads_that_read_every_token_keep_them(kwargs, why):
    m = TIMM.create_model("vit_tiny_patch16_224", num_classes=10, img_size=64, **kwargs)
    convert(m, kernels="none")
    assert keep_head_tokens(m) == {"blocks": 0, "line": f"every token kept: {why}"}
    assert not getattr(m.blocks[-1], "head_rows", 0)


@pytest.mark.parametrize("kwargs, why", [
    (dict(pool="avg"), "its head averages the tokens (pool='avg')"),
    (dict(batch_second=True), "its stream is batch-second")])
def test_own_vits_that_need_every_token_keep_them(kwargs, why):
    vit = ViT(CONFIGS["tiny"], **kwargs)
    convert(vit, kernels="none")
    assert keep_head_tokens(vit) == {"blocks": 0, "line": f"every token kept: {why}"}


def test_a_model_without_a_vit_keeps_every_token():
    got = keep_head_tokens(nn.Sequential(nn.Linear(4, 4)))
    assert got["blocks"] == 0 and got["line"].startswith("every token kept: no ViT")


class _Quantized(nn.Module):
    """A linear layer of another technique (not an nn.Linear): run whole."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("wrap", [False, True], ids=["linear", "other-layer"])
@pytest.mark.parametrize("proj_bias", [True, False])
def test_first_queries_are_the_first_rows_of_the_whole_attention(wrap, proj_bias):
    torch.manual_seed(0)
    attn = SelfAttention(32, 4).eval()
    if wrap:
        attn.qkv = _Quantized(attn.qkv)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        want = attn(x, proj_bias=proj_bias)[:, :2]
        got = attn.first_queries(x, 2, proj_bias=proj_bias)
    assert got.shape == (2, 2, 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_first_queries_refuse_the_batch_second_layout():
    with pytest.raises(ValueError, match="batch-second"):
        SelfAttention(32, 4, batch_second=True).first_queries(torch.randn(7, 2, 32), 1)


def test_head_tokens_without_convert_is_refused():
    with pytest.raises(FasttrainError, match="head_tokens works on fasttrain's blocks"):
        InferRung("h", "x", head_tokens=True)
