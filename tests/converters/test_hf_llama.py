"""fasttrain.converters on transformers' Llama, Mistral and Qwen2 (CPU; the fused paths' Triton
kernels interpreted): the converted causal LM gives the original's loss, logits and every
gradient, plain and fused; the report counts what it did; state dicts, tied embeddings and
parameter objects are untouched; what the converted classes do not compute goes back to the
library's forward; configurations the layers do not compute are refused with their reason; and
the ``convert`` switch, the ``hf:llama`` workload, its peer and its ladder rung behave."""
from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

from tests.interpreted import interpret, kernels_interpreted  # noqa: E402,F401

with kernels_interpreted():  # the Triton modules behind rmsnorm, swiglu and rope
    import fasttrain.kernels.activations  # noqa: F401
    import fasttrain.kernels.norms  # noqa: F401
    import fasttrain.kernels.rope  # noqa: F401
# (kernels.linear_cross_entropy, behind kernels=loss, is plain PyTorch: no Triton to interpret)

import fasttrain  # noqa: E402
import fasttrain.converters.apply as convert_apply  # noqa: E402
from fasttrain.converters import convert, hf_llama, registry  # noqa: E402
from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.ladder.rungs import build_ladder  # noqa: E402
from fasttrain.layers.loss import LMHeadLoss  # noqa: E402
from fasttrain.layers.mlp import SwiGLU  # noqa: E402
from fasttrain.measure.parity import compare  # noqa: E402
from fasttrain.peers import run_peer  # noqa: E402
from fasttrain.peers.hf_llama_peer import TINY, causal_lm_config, llama_config  # noqa: E402
from fasttrain.recipe import Recipe  # noqa: E402
from fasttrain.run.loop import train  # noqa: E402
from fasttrain.workloads import load_workload  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2")
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
COUNTS = {"transformers CausalLM": 1, "transformers decoder Model": 1,
          "transformers DecoderLayer": 2}
PLAIN_REL, FUSED_REL = 1e-6, 1e-4
BF16_LOSS_REL, BF16_REL = 1e-3, 5e-2  # measured: ≤ 4e-5 and ≤ 2.1e-2 (RoPE: see test)


# ----------------------------------------------------------------------------- helpers

def tiny_config(family: str, **extra):
    """A miniature config of ``family`` (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 512,
    SDPA, no cache). Llama is the hf:llama workload's (llama3 RoPE, tied embeddings); Mistral
    has no sliding window unless ``extra`` sets one (its default is 4096)."""
    if family == "llama":
        return llama_config(transformers, dict(TINY, **extra))
    common = dict(SMALL, attn_implementation="sdpa", use_cache=False)
    if family == "mistral":
        return transformers.MistralConfig(**{**common, "sliding_window": None, **extra})
    return transformers.Qwen2Config(**common, **extra)


def build(family: str, seed: int = 0, tokens: int = 16, **extra):
    """The miniature causal LM (train mode) with its norm weights and biases moved off their
    init (ones and zeros: a dropped weight or bias would not show), and (2, tokens) ids."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **extra))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p), alpha=0.1)
    ids = torch.randint(0, 512, (2, tokens), generator=torch.Generator().manual_seed(seed))
    return model.train(), ids


def converted(model: nn.Module, **kwargs):
    """A converted deep copy and its report."""
    twin = copy.deepcopy(model)
    return twin, convert(twin, **kwargs)


def run(model: nn.Module, ids: torch.Tensor, labels: bool = True,
        autocast: torch.dtype | None = None, **kwargs):
    """The loss (with labels) or the logits (without: a weighted sum of them is what is
    backpropagated), every parameter's gradient, and the model's output."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(input_ids=ids, labels=ids if labels else None, **kwargs)
    if labels:
        value = out.loss
        value.backward()
    else:
        value = out.logits
        (value.float() * torch.linspace(-1, 1, value.numel()).view_as(value)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    return value.detach().float(), grads, out


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str = "") -> None:
    """Elementwise within ``rel`` of the reference tensor's largest magnitude."""
    scale = max(want.abs().max().item(), 1e-12)
    torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=rel * scale,
                               msg=lambda m: f"{what}: {m}")


def assert_same(a, b, rel: float, value_rel: float | None = None) -> None:
    (va, ga, _), (vb, gb, _) = a, b
    assert ga.keys() == gb.keys()
    assert_close(va, vb, rel if value_rel is None else value_rel, "loss/logits")
    for n in gb:
        assert_close(ga[n], gb[n], rel, n)


@pytest.fixture
def library_calls(monkeypatch):
    """The converted classes' calls handed back to the library's forward, by class name."""
    calls: list[str] = []
    real = hf_llama.library_forward

    def spy(m, *args, **kwargs):
        calls.append(type(m).__name__)
        return real(m, *args, **kwargs)

    monkeypatch.setattr(hf_llama, "library_forward", spy)
    return calls


@pytest.fixture
def tied_calls(monkeypatch):
    """One entry per call of ``tied_lookup`` by the converted classes."""
    calls: list[int] = []
    real = hf_llama.tied_lookup
    monkeypatch.setattr(hf_llama, "tied_lookup", lambda *a: calls.append(1) or real(*a))
    return calls


def qwen2_json(tmp_path) -> str:
    """A tiny Qwen2 config.json (as a Hub checkpoint's, with model_type and architectures)."""
    path = tmp_path / "qwen2.json"
    path.write_text(json.dumps(dict(SMALL, model_type="qwen2", max_position_embeddings=256,
                                    architectures=["Qwen2ForCausalLM"])))
    return str(path)


# ----------------------------------------------------------------------------- the function

@pytest.mark.parametrize("family", FAMILIES)
def test_converted_plain_path_keeps_loss_logits_and_every_gradient(family, library_calls):
    """Plain path (fp32): the converted copy's loss with labels, and its logits without, and
    every parameter gradient of each equal the original's; with labels the fast path runs (no
    call goes back to the library) and ``logits`` is None; without labels only the causal LM
    hands the call to the library, whose call of the decoder model runs the converted chain."""
    model, ids = build(family)
    twin, report = converted(model)
    assert dict(report.converted) == COUNTS and not report.skipped, report.skipped_lines()
    assert report.summary() == ("transformers CausalLM ×1; transformers decoder Model ×1; "
                                "transformers DecoderLayer ×2")
    lib = type(model)  # converted, the model stays a subclass of its library class too
    assert isinstance(twin, hf_llama.HFCausalLM) and isinstance(twin, lib)
    assert isinstance(twin, transformers.PreTrainedModel) and hasattr(twin, "generate")
    assert isinstance(twin.model, hf_llama.HFModel) and isinstance(twin.model, type(model.model))
    layer = twin.model.layers[0]
    assert isinstance(layer, hf_llama.HFDecoderLayer) and type(layer.mlp) is SwiGLU
    assert isinstance(layer, type(model.model.layers[0]))
    assert type(layer.self_attn) is hf_llama.HFAttention
    assert type(layer.input_layernorm) is hf_llama.HFRMSNorm
    assert type(twin.model.norm) is hf_llama.HFRMSNorm

    got = run(twin, ids)
    assert got[2].logits is None
    assert library_calls == []
    assert_same(got, run(model, ids), PLAIN_REL)
    got = run(twin, ids, labels=False)
    assert library_calls == ["HFCausalLM"]
    assert got[0].shape == (2, ids.shape[1], 512)
    assert_same(got, run(model, ids, labels=False), PLAIN_REL)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_paths_keep_loss_logits_and_every_gradient(family):
    """convert(kernels="fused") (Triton interpreted, fp32): RMSNorm ×5, SwiGLU ×2, RoPE ×2 and
    the fused loss ×1 switched on; the loss within 1e-4 relative, the logits and every
    gradient within 1e-4 of each tensor's largest magnitude."""
    model, ids = build(family)
    twin, report = converted(model, kernels="fused")
    assert report.kernels_kept is None
    assert dict(report.kernels) == {
        "RMSNorm (with the residual add before it) in Triton": 5,
        "SiLU(gate) · up in one Triton kernel": 2,
        "RoPE of q and k in one Triton kernel": 2,
        "linear + cross-entropy, the logits' gradient written by the loss's kernel": 1}
    assert twin.head_loss.fused and twin.model.layers[1].self_attn.rotary.fused
    assert_same(run(twin, ids), run(model, ids), FUSED_REL)
    assert_same(run(twin, ids, labels=False), run(model, ids, labels=False), FUSED_REL)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_autocast_keeps_the_loss_and_gradients(family, fused):
    """Under CPU bf16 autocast the converted model (plain, and fused interpreted) gives the
    original's loss within 1e-3 relative and every gradient within 5e-2 of its largest value.
    (Not exact on the plain path: the library's RoPE multiplies bf16 q, k by fp32 cos, sin and
    so rotates in fp32; ``layers.rope.apply_rope`` casts cos, sin to bf16 and rotates in bf16.)"""
    model, ids = build(family)
    twin, _ = converted(model, kernels="fused" if fused else "none")
    got, want = run(twin, ids, autocast=torch.bfloat16), run(model, ids, autocast=torch.bfloat16)
    assert_same(got, want, BF16_REL, value_rel=BF16_LOSS_REL)


@pytest.mark.parametrize("pad, hook", [(None, False), (0, False), (None, True)],
                         ids=["tied", "padding-row", "hooked-embedding"])
def test_tied_embedding_is_looked_up_with_the_head_unless_its_gradient_differs(pad, hook,
                                                                              tied_calls):
    """Llama's embedding tied to its head: with labels the converted causal LM looks the rows
    up through ``tied_lookup`` (the two gradients meet in one place), and every gradient equals
    the library's; with a padding row (whose share of the embedding's gradient the library
    keeps at zero), or a hook on the embedding (its forward must run), it does not, and the
    gradients still equal the library's."""
    model, ids = build("llama", pad_token_id=pad)
    ids[0, :3] = 0  # the padding id among the inputs, repeated
    twin, _ = converted(model)
    seen = []
    if hook:
        twin.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(1))
    got = run(twin, ids)
    assert len(tied_calls) == (1 if pad is None and not hook else 0) and len(seen) == int(hook)
    assert_same(got, run(model, ids), PLAIN_REL)


def test_compiled_converted_model_gives_the_eager_loss_and_gradients():
    """torch.compile (aot_eager) of the converted Llama's training forward, tied lookup
    included, is one graph (``fullgraph``: a break costs copies of the gradients that cross it)
    and gives the eager loss and gradients."""
    model, ids = build("llama")
    convert(model)
    want = run(model, ids)
    torch._dynamo.reset()
    compiled = torch.compile(lambda i: model(input_ids=i, labels=i).loss, backend="aot_eager",
                             fullgraph=True)
    model.zero_grad(set_to_none=True)
    loss = compiled(ids)
    loss.backward()
    got = (loss.detach(), {n: p.grad for n, p in model.named_parameters()}, None)
    assert_same(got, want, PLAIN_REL)


# ----------------------------------------------------------------------------- state dicts

@pytest.mark.parametrize("family", ["llama", "qwen2"])  # tied embeddings, and q/k/v biases
def test_state_dicts_round_trip_both_ways(family):
    """Keys, shapes and dtypes are unchanged (the loss layer added to the causal LM holds no
    state); the original's state dict loads strictly into a converted model (same loss), the
    converted one's into a fresh library model; the parameters are the very objects they were,
    and Llama's tied LM head is still the embedding."""
    model, ids = build(family)
    params = dict(model.named_parameters())
    want = {k: v.clone() for k, v in model.state_dict().items()}
    convert(model)
    assert isinstance(model.head_loss, LMHeadLoss)
    got = model.state_dict()
    assert list(got) == list(want)
    assert all(got[k].shape == want[k].shape and got[k].dtype == want[k].dtype for k in want)
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    tied = family == "llama"
    assert ("lm_head.weight" in got) and (
        (model.lm_head.weight is model.model.embed_tokens.weight) == tied)

    other, _ = build(family, seed=1)
    other, _ = converted(other)
    other.load_state_dict(want, strict=True)
    with torch.no_grad():
        assert_close(other(input_ids=ids, labels=ids).loss,
                     model(input_ids=ids, labels=ids).loss, PLAIN_REL)
    fresh, _ = build(family, seed=2)
    fresh.load_state_dict(model.state_dict(), strict=True)
    if tied:
        assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    with torch.no_grad():
        assert_close(fresh(input_ids=ids, labels=ids).loss,
                     model(input_ids=ids, labels=ids).loss, PLAIN_REL)


def test_an_optimizer_built_before_converting_trains_the_converted_model():
    """The optimizer holds the parameters it held before the swap, and its step moves every
    one of them through the converted model's gradients."""
    model, ids = build("llama")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    convert(model)
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters(),
                                      strict=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())


# ----------------------------------------------------------------------------- fallbacks

def test_attention_dropout_goes_to_the_library_attention(library_calls):
    """Attention dropout in train mode: the converted attention hands the call to the library's
    (the decoder layers' chain still runs), and under the same seed the loss is the original's;
    another seed gives another loss (the dropout happens)."""
    model, ids = build("llama", attention_dropout=0.5)
    twin, report = converted(model)
    assert dict(report.converted) == COUNTS
    library_calls.clear()  # (the self-check's own calls)
    losses = []
    for m, seed in ((twin, 1), (model, 1), (model, 2)):
        torch.manual_seed(seed)
        losses.append(m(input_ids=ids, labels=ids).loss.item())
    assert library_calls == ["HFAttention", "HFAttention"]
    assert losses[0] == pytest.approx(losses[1], rel=PLAIN_REL) and losses[1] != losses[2]


def test_a_padding_mask_goes_to_the_library_forward(library_calls):
    """An attention mask with padding (zeros) is not in the fast path: the decoder model and its
    layers hand the call to the library's forward, and the loss and logits are the original's
    (and differ from the unmasked ones: the mask matters)."""
    model, ids = build("llama")
    twin, _ = converted(model)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    got = run(twin, ids, attention_mask=mask)
    assert "HFModel" in library_calls and "HFDecoderLayer" in library_calls
    assert_same(got, run(model, ids, attention_mask=mask), PLAIN_REL)
    assert not torch.allclose(got[0], run(model, ids)[0])
    assert_same(run(twin, ids, labels=False, attention_mask=mask),
                run(model, ids, labels=False, attention_mask=mask), PLAIN_REL)


def test_a_kv_cache_goes_to_the_library_forward():
    """use_cache=True in eval mode: the logits and the cache's keys and values (every layer)
    are the original's."""
    model, ids = build("llama")
    model.eval()
    twin, _ = converted(model)
    with torch.no_grad():
        want, got = model(input_ids=ids, use_cache=True), twin(input_ids=ids, use_cache=True)
    assert got.past_key_values is not None
    assert_close(got.logits, want.logits, PLAIN_REL)
    pairs = list(zip(got.past_key_values.layers, want.past_key_values.layers, strict=True))
    assert len(pairs) == 2
    for a, b in pairs:
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_greedy_generation_gives_the_originals_tokens():
    """model.generate (greedy, KV cache, eval mode) of the converted model gives the original's
    tokens; the converted model is still a transformers PreTrainedModel."""
    model, ids = build("llama")
    model.eval()
    twin, _ = converted(model)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                          do_sample=False, use_cache=True, pad_token_id=0)
    got = twin.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                        do_sample=False, use_cache=True, pad_token_id=0)
    assert want.shape == (2, ids.shape[1] + 3) and torch.equal(got, want)
    assert isinstance(twin, transformers.PreTrainedModel)


# ----------------------------------------------------------------------------- refusals

def test_a_gelu_mlp_is_refused_and_the_model_falls_back(library_calls):
    """hidden_act="gelu": the decoder layers and their MLPs keep their library classes with the
    reason; the norms convert; the converted decoder model, its layers not all converted, hands
    the call to the library's forward; loss and gradients are the original's."""
    model, ids = build("llama", hidden_act="gelu")
    twin, report = converted(model)
    assert dict(report.converted) == {"transformers CausalLM": 1,
                                      "transformers decoder Model": 1,
                                      "transformers RMSNorm": 4}
    assert report.skipped_lines() == [
        "transformers DecoderLayer at model.layers.0 (and 1 more) left as it was: MLP: "
        "activation GELUActivation is not SiLU",
        "transformers MLP at model.layers.0.mlp (and 1 more) left as it was: activation "
        "GELUActivation is not SiLU"]
    lib = transformers.models.llama.modeling_llama
    assert all(type(layer) is lib.LlamaDecoderLayer for layer in twin.model.layers)
    assert all(type(layer.mlp) is lib.LlamaMLP for layer in twin.model.layers)
    assert type(twin.model.layers[0].input_layernorm) is hf_llama.HFRMSNorm
    got = run(twin, ids)
    assert library_calls == ["HFModel"]
    assert_same(got, run(model, ids), PLAIN_REL)


def test_a_sliding_window_is_refused_and_the_model_falls_back(library_calls):
    """Qwen2 with sliding-window layers (window 4, 16 tokens): the decoder layers stay the
    library's with the reason, the model falls back to the library's forward, and the loss and
    gradients are the original's, which the window does change."""
    window = dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    model, ids = build("qwen2", **window)
    twin, report = converted(model)
    assert report.converted["transformers DecoderLayer"] == 0
    assert report.skipped_lines() == [
        "transformers DecoderLayer at model.layers.0 (and 1 more) left as it was: attention: "
        "sliding-window attention (4 tokens) is not in the converted attention"]
    lib = transformers.models.qwen2.modeling_qwen2
    assert all(type(layer) is lib.Qwen2DecoderLayer for layer in twin.model.layers)
    got = run(twin, ids)
    assert library_calls == ["HFModel"]
    assert_same(got, run(model, ids), PLAIN_REL)
    full, _ = build("qwen2")
    full.load_state_dict(model.state_dict())
    assert not torch.allclose(run(full, ids)[0], got[0])


def test_a_mistral_sliding_window_is_refused():
    """Mistral with sliding_window=4 (16 tokens): the decoder layers are refused with the
    sliding-window reason, and the converted model's loss is the original's."""
    model, ids = build("mistral", sliding_window=4)
    twin, report = converted(model)
    assert ("transformers DecoderLayer at model.layers.0 (and 1 more) left as it was: "
            "attention: sliding-window attention (4 tokens) is not in the converted attention"
            in report.skipped_lines()), report.summary()
    assert_same(run(twin, ids), run(model, ids), PLAIN_REL)


class NoRope(nn.Module):
    """A rotary layer that forgets to rotate."""

    def forward(self, q, k, cos, sin):
        return q, k


def test_a_failed_numeric_self_check_leaves_the_layers_as_they_were(monkeypatch, library_calls):
    """A decoder-layer converter whose swap drops RoPE fails its self-check: both layers stay
    the library's with the reason, their norms and MLPs convert one by one, the decoder model
    falls back to the library's forward and the loss and gradients are the original's;
    check=False trusts the broken swap and the loss moves."""
    real = next(c for c in registry().values() if c.name == "transformers DecoderLayer")

    def drops_rope(m):
        hf_llama.swap_decoder_layer(m)
        m.self_attn.rotary = NoRope()

    broken = dataclasses.replace(real, swap=drops_rope)
    table = {**registry(), **{s: broken for s in real.sources}}
    monkeypatch.setattr(convert_apply, "registry", lambda: table)
    model, ids = build("llama")
    twin, report = converted(model)
    assert dict(report.converted) == {"transformers CausalLM": 1,
                                      "transformers decoder Model": 1,
                                      "transformers RMSNorm": 4, "transformers MLP": 2}
    assert sum(report.skipped.values()) == 2
    lines = report.skipped_lines()
    assert all(line.startswith("transformers DecoderLayer at model.layers.")
               and line.split(" left as it was: ")[1].startswith(
                   "numeric self-check failed (largest difference ") for line in lines), lines
    lib = transformers.models.llama.modeling_llama
    assert all(type(layer) is lib.LlamaDecoderLayer for layer in twin.model.layers)
    assert all(type(layer.self_attn) is lib.LlamaAttention for layer in twin.model.layers)
    got = run(twin, ids)
    assert library_calls == ["HFModel"]
    assert_same(got, run(model, ids), PLAIN_REL)

    trusted, unchecked = converted(model, check=False)
    assert unchecked.converted["transformers DecoderLayer"] == 2
    assert not torch.allclose(run(trusted, ids)[0], got[0])


def test_convert_is_the_public_api_and_strict_says_why():
    """fasttrain.convert is the converter; a second convert of a converted model finds nothing;
    strict=True on a model whose every candidate is refused names the first reason."""
    assert fasttrain.convert is convert
    model, _ = build("llama")
    assert convert(model, strict=True)
    again = convert(model)
    assert not again and not again.skipped
    bare = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", hidden_act="gelu"))
    bare.lm_head = nn.Linear(64, 512, bias=True)  # refused: the head has a bias
    # refused: the final norm is not RMSNorm; nor, without a weight, torch.nn's to convert
    bare.model.norm = nn.LayerNorm(64, elementwise_affine=False)
    for layer in bare.model.layers:  # no norm left to convert on its own either
        layer.input_layernorm = layer.post_attention_layernorm = nn.LayerNorm(
            64, elementwise_affine=False)
    with pytest.raises(FasttrainError, match=r"^LlamaForCausalLM: nothing converted; "
                                             r"transformers CausalLM at \(the model\) left as "
                                             r"it was: the LM head is not a plain bias-free"):
        convert(bare, strict=True)


# ----------------------------------------------------------------------------- training

def test_convert_keeps_the_training_losses_and_fused_kernels_stay_within_tf32():
    """Recipe(convert=True) trains hf:llama with the plain run's very losses and says what it
    converted; kernels=fused (interpreted) stays within tf32 tolerance and switches RMSNorm,
    SwiGLU, RoPE and the fused linear + cross-entropy on (the loss layer once)."""
    wl = load_workload("hf:llama", "tiny", seq_len=32)
    plain = train(wl, Recipe(batch=2), steps=2, warmup=0, device="cpu")
    conv = train(wl, Recipe(batch=2, convert=True), steps=2, warmup=0, device="cpu")
    assert conv.losses == plain.losses and not conv.warnings, conv.warnings
    assert "transformers DecoderLayer ×2" in conv.applied["convert"]
    assert "convert" not in plain.applied
    fused = train(wl, Recipe(batch=2, convert=True, kernels="fused"), steps=2, warmup=0,
                  device="cpu")
    assert compare(fused.losses, plain.losses, "tf32")["passed"], (fused.losses, plain.losses)
    assert not fused.warnings, fused.warnings
    kernels = fused.applied["kernels"].split("; ")
    assert "RMSNorm (with the residual add before it) in Triton ×5" in kernels
    assert "SiLU(gate) · up in one Triton kernel ×2" in kernels
    assert "RoPE of q and k in one Triton kernel ×2" in kernels
    assert "linear + cross-entropy, the logits' gradient written by the loss's kernel ×1" in kernels
    assert len(kernels) == 4


def test_bf16_stream_reaches_the_converted_model():
    """stream_dtype=bf16 under bf16-mixed finds the converted decoder model (HFModel); without
    convert it changes nothing and the warning suggests convert=true."""
    wl = load_workload("hf:llama", "tiny", seq_len=32)
    base = Recipe(batch=2, precision="bf16-mixed", stream_dtype="bf16")
    res = train(wl, base.replace(convert=True), steps=1, warmup=0, device="cpu")
    assert "HFModel in bf16" in res.applied["stream_dtype"] and not res.warnings, res.warnings
    assert all(math.isfinite(x) for x in res.losses)
    unconverted = train(wl, base, steps=1, warmup=0, device="cpu")
    assert "stream_dtype" not in unconverted.applied
    assert [w for w in unconverted.warnings if w.startswith("stream_dtype: ")
            and "set convert=true" in w], unconverted.warnings


def test_fused_kernels_without_convert_suggest_it():
    """kernels=fused on hf:llama without convert switches only the fused loss (the workload's
    own layer) and warns, suggesting convert=true."""
    res = train(load_workload("hf:llama", "tiny", seq_len=32), Recipe(batch=2, kernels="fused"),
                steps=1, warmup=0, device="cpu")
    assert res.applied["kernels"] == "linear + cross-entropy, the logits' gradient written by the loss's kernel ×1"
    assert [w for w in res.warnings if w.startswith("kernels: ") and "set convert=true" in w], \
        res.warnings


# ----------------------------------------------------------------------------- the workload

def test_workload_from_a_config_file_trains_converted(tmp_path):
    """config= a Qwen2 config.json (with model_type) makes a Qwen2ForCausalLM workload with the
    asked seq_len, which trains a step with convert=True, every decoder layer converted."""
    path = qwen2_json(tmp_path)
    wl = load_workload("hf:llama", "tiny", config=path, seq_len=16)
    assert type(wl.config) is transformers.Qwen2Config and wl.seq == 16
    assert wl.describe()["model_type"] == "qwen2" and wl.describe()["config"] == path
    assert type(wl.build_model().lm).__name__ == "Qwen2ForCausalLM"
    res = train(wl, Recipe(batch=2, convert=True), steps=1, warmup=0, device="cpu")
    assert res.applied["convert"] == ("transformers CausalLM ×1; transformers decoder Model ×1; "
                                      "transformers DecoderLayer ×2"), res.applied
    assert not res.warnings and math.isfinite(res.losses[0])


def test_workload_loss_looks_the_tied_embedding_up_with_the_head(tied_calls):
    """The hf:llama workload's loss (its own wrapper, not the causal LM's forward) goes through
    ``tied_lookup`` once converted, with the unconverted model's loss and gradients."""
    wl = load_workload("hf:llama", "tiny", seq_len=16)
    model = wl.build_model()
    twin = copy.deepcopy(model)
    convert(twin.lm)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    ids[:, :4] = 5  # repeated tokens

    def loss_and_grads(m):
        m.zero_grad(set_to_none=True)
        loss = m(ids, ids)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}, None

    assert_same(loss_and_grads(twin), loss_and_grads(model), PLAIN_REL)
    assert tied_calls == [1]


def test_workload_refuses_what_it_cannot_build(tmp_path):
    """A config of another model_type, a missing config file and hf:gpt2 are FasttrainErrors
    that say what is wrong."""
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(FasttrainError, match="model_type 'gpt2' is not llama, mistral or qwen2"):
        load_workload("hf:llama", "tiny", config=str(gpt2))
    with pytest.raises(FasttrainError, match="absent.json: no such file"):
        load_workload("hf:llama", "tiny", config=str(tmp_path / "absent.json"))
    with pytest.raises(FasttrainError, match="hf:gpt2 is not a workload: use hf:llama"):
        load_workload("hf:gpt2", "tiny")


def tiny_reference():
    torch.manual_seed(123)
    return transformers.AutoModelForCausalLM.from_config(causal_lm_config(transformers, "tiny"))


def test_workload_weights_are_checked_and_loaded(tmp_path):
    """weights=: a file with wrong keys is refused when the workload is made; the right file
    loads exactly, the tie kept. What the file must hold: every key of the model's state dict,
    the tied ``lm_head.weight`` and ``model.embed_tokens.weight`` both, as separate tensors
    (safetensors' save_file refuses tensors that share memory, so they are cloned here; its
    save_model and transformers' save_pretrained each drop one of the two: see the next test)."""
    from safetensors.torch import save_file

    wrong = tmp_path / "wrong.safetensors"
    save_file({"not_a_key": torch.zeros(2)}, str(wrong))
    with pytest.raises(FasttrainError, match=r"keys missing .*; 1 unexpected \(not_a_key\)"):
        load_workload("hf:llama", "tiny", weights=str(wrong))
    ref = tiny_reference()
    want = ref.state_dict()
    assert want["lm_head.weight"].data_ptr() == want["model.embed_tokens.weight"].data_ptr()
    good = tmp_path / "good.safetensors"
    save_file({k: v.clone() for k, v in want.items()}, str(good))
    lm = load_workload("hf:llama", "tiny", weights=str(good)).build_model().lm
    got = lm.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert lm.lm_head.weight is lm.model.embed_tokens.weight


def test_workload_loads_a_save_pretrained_checkpoint(tmp_path):
    """weights= the model.safetensors that transformers' save_pretrained writes for the tied
    tiny Llama (no lm_head.weight) loads, the LM head tied to the loaded embedding."""
    ref = tiny_reference()
    ref.save_pretrained(str(tmp_path / "ckpt"))
    lm = load_workload("hf:llama", "tiny",
                       weights=str(tmp_path / "ckpt" / "model.safetensors")).build_model().lm
    assert torch.equal(lm.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight


# ----------------------------------------------------------------------------- peer and ladder

def test_peer_runs_tiny_and_from_a_config_file(tmp_path):
    """The hf:llama peer trains the tiny Llama without error; with options config= a Qwen2
    config.json its row names Qwen2ForCausalLM and the file."""
    row = run_peer("hf:llama", size="tiny", steps=2, warmup=0, device="cpu")
    assert row["error"] is None, row["error"]
    assert row["peer"].startswith("transformers:LlamaForCausalLM(Llama-3.2-1B,tiny,sdpa)")
    assert len(row["losses"]) == 2 and all(math.isfinite(x) for x in row["losses"])
    row = run_peer("hf:llama", size="tiny", steps=1, warmup=0, device="cpu",
                   options={"config": qwen2_json(tmp_path)})
    assert row["error"] is None, row["error"]
    assert row["peer"].startswith("transformers:Qwen2ForCausalLM(qwen2.json,tiny,sdpa)")


def test_ladder_converts_right_before_compile():
    """hf:llama's ladder has a convert rung right before compile, and compile keeps it on."""
    ladder = build_ladder(load_workload("hf:llama", "tiny"), None, Recipe())
    names = [rung.name for rung, _ in ladder]
    assert names.index("convert") + 1 == names.index("compile")
    recipes = {rung.name: recipe for rung, recipe in ladder}
    assert recipes["convert"].convert and recipes["compile"].convert
    assert not recipes[names[names.index("convert") - 1]].convert
