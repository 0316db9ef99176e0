"""The llama workload: tiny training, causality, GQA, Llama 3 RoPE, parameter count, data."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fasttrain.errors import FasttrainError
from fasttrain.layers.attention import attention
from fasttrain.layers.rope import apply_rope
from fasttrain.workloads import load_workload
from fasttrain.workloads import llama
from fasttrain.workloads.llama import CONFIGS, Llama, LlamaWorkload, rope_frequencies, rope_tables


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Data into tmp_path; one intra-op thread (tiny ops only lose from more, worst when loaded)."""
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path
    torch.set_num_threads(threads)


def tiny_batch(wl, n=4):
    ds = wl.dataset()
    return wl.collate([ds[i] for i in range(n)])


def test_registry_and_options():
    wl = load_workload("llama", "tiny")
    assert isinstance(wl, LlamaWorkload)
    assert (wl.unit, wl.default_batch, wl.cfg.seq) == ("tok", 4, 64)
    assert load_workload("llama", "tiny", seq_len=32).dataset()[0]["input_ids"].shape == (32,)
    with pytest.raises(FasttrainError):
        load_workload("llama", "tiny", token_dtype="int8")


def test_tiny_trains():
    wl = load_workload("llama", "tiny")
    torch.manual_seed(0)
    model = wl.build_model()
    batch = tiny_batch(wl)
    assert batch["input_ids"].shape == (4, 64) and int(batch["input_ids"].max()) < 512
    n = wl.count(batch)
    loss = model(**batch)
    assert torch.isfinite(loss) and abs(loss.item() / n - math.log(512)) < 0.3
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = loss.item() / n
    for _ in range(30):
        opt.zero_grad(set_to_none=True)
        (model(**batch) / n).backward()
        opt.step()
    assert model(**batch).item() / n < 0.7 * first


@pytest.mark.parametrize("hook", [False, True], ids=["tied-lookup", "hooked-embedding"])
def test_tied_embedding_and_head_give_the_gradients_of_the_weight_used_twice(hook, monkeypatch):
    """The forward looks the embedding up with the head (``tied_lookup``, once), and the loss
    and every gradient equal the plain path's: the embedding called as a module, the head's
    weight passed as it is. A forward hook on the embedding keeps the plain path (it runs)."""
    wl = load_workload("llama", "tiny")
    torch.manual_seed(0)
    model = wl.build_model()
    batch = tiny_batch(wl, 2)
    calls, seen = [], []
    real = llama.tied_lookup
    monkeypatch.setattr(llama, "tied_lookup", lambda *a: calls.append(1) or real(*a))
    if hook:
        model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(1))

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    got = loss_and_grads(lambda: model(**batch))
    assert (calls, seen) == (([], [1]) if hook else ([1], []))
    want = loss_and_grads(lambda: model.head_loss(model.hidden(batch["input_ids"]),
                                                  model.lm_head.weight, batch["labels"]))
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-5, atol=1e-6 * g.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_init_is_deterministic_under_seed():
    torch.manual_seed(3)
    a = Llama(CONFIGS["tiny"])
    torch.manual_seed(3)
    b = Llama(CONFIGS["tiny"])
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert a.lm_head.weight is a.embed_tokens.weight
    assert abs(a.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 0.002


def test_causality():
    torch.manual_seed(0)
    model = Llama(CONFIGS["tiny"]).eval()
    ids = torch.randint(0, 512, (2, 64))
    t = 37
    changed = ids.clone()
    changed[:, t] = (ids[:, t] + 1) % 512
    with torch.no_grad():
        a, b = model.logits(ids), model.logits(changed)
    assert a.shape == (2, 64, 512)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-5)
    assert (a[:, t:] - b[:, t:]).abs().amax() > 1e-3


def test_gqa_equals_repeat_interleave(monkeypatch):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8)
    k, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         is_causal=True)
    torch.testing.assert_close(attention(q, k, v, causal=True, enable_gqa=True), ref)
    # the module's native path and its repeat_interleave fallback agree
    attn = llama.Attention(CONFIGS["tiny"])
    cos, sin = rope_tables(CONFIGS["tiny"])
    x = torch.randn(2, 64, 64)
    native = attn(x, cos, sin)
    monkeypatch.setattr(llama, "native_gqa", lambda q: False)
    torch.testing.assert_close(attn(x, cos, sin), native, rtol=1e-5, atol=1e-6)


def llama3_reference(theta, dim, factor=32.0, low=1.0, high=4.0, old_len=8192):
    """Meta's apply_scaling, one frequency at a time, in float64."""
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / theta ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("size", ["tiny", "base", "large"])
def test_rope_llama3_scaling(size):
    cfg = CONFIGS[size]
    d = cfg.dim // cfg.heads
    got = rope_frequencies(cfg)
    assert got.dtype == torch.float32 and got.shape == (d // 2,)
    torch.testing.assert_close(got.double(), llama3_reference(500000.0, d), rtol=2e-6, atol=0)
    cos, sin = rope_tables(cfg)
    pos = torch.tensor([0.0, 1.0, 33.0, cfg.seq - 1.0], dtype=torch.float64)
    angle = torch.outer(pos, llama3_reference(500000.0, d)).repeat(1, 2)
    torch.testing.assert_close(cos[pos.long()].double(), angle.cos(), rtol=0, atol=1e-3)
    torch.testing.assert_close(sin[pos.long()].double(), angle.sin(), rtol=0, atol=1e-3)


def test_rope_is_relative():
    cos, sin = rope_tables(CONFIGS["tiny"])
    q, k = torch.randn(16), torch.randn(16)

    def score(i, j):
        qi = apply_rope(q.view(1, 1, 1, 16), cos[i], sin[i])
        kj = apply_rope(k.view(1, 1, 1, 16), cos[j], sin[j])
        return (qi * kj).sum()

    torch.testing.assert_close(score(5, 2), score(40, 37), rtol=1e-4, atol=1e-4)


def test_parameter_counts_on_meta():
    with torch.device("meta"):
        base, large = Llama(CONFIGS["base"]), Llama(CONFIGS["large"])
    assert sum(p.numel() for p in base.parameters()) == 1_235_814_400  # Llama-3.2-1B
    assert sum(p.numel() for p in large.parameters()) == 3_212_749_824  # Llama-3.2-3B
    assert base.rope_cos.shape == (2048, 64) and "rope_cos" not in base.state_dict()


def test_count_ignores_masked_labels():
    wl = load_workload("llama", "tiny")
    labels = torch.zeros(2, 8, dtype=torch.long)
    labels[0, :3] = -100
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": labels}
    assert wl.count(batch) == 13
    torch.manual_seed(0)
    model = wl.build_model()
    masked = model(**batch)
    labels[0, :3] = 0
    assert model(**batch).item() > masked.item()


def test_user_token_file(tmp_path):
    good = tmp_path / "good.bin"
    (np.arange(1000) % 512).astype(np.uint16).tofile(good)
    wl = load_workload("llama", "tiny", data=str(good), token_dtype="uint16")
    ds = wl.dataset()
    assert len(ds) == 15 and int(ds[3]["labels"][-1]) == (4 * 64) % 512
    bad = tmp_path / "bad.bin"
    np.full(200, 512, dtype=np.uint32).tofile(bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        load_workload("llama", "tiny", data=str(bad)).dataset()


def test_matches_transformers_llama():
    """Same logits as the HF peer's LlamaForCausalLM (tiny shapes) given the same weights."""
    transformers = pytest.importorskip("transformers")
    from fasttrain.peers.hf_llama_peer import TINY, llama_config

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(llama_config(transformers, TINY)).eval()
    ours = Llama(CONFIGS["tiny"]).eval()
    ours.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()})
    torch.testing.assert_close(ours.rope_cos, hf.model.rotary_emb(torch.zeros(1), torch.arange(
        64)[None])[0][0], rtol=1e-6, atol=1e-6)
    ids = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
