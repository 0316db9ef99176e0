"""The per-module timer on any model: blocks that return dataclasses, dicts, tuples or
ModelOutput-like objects all get a backward span; the breakdown adds up to the step it claims;
the hooks' overhead is a non-negative figure with its noise."""
import time
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from fasttrain import SimpleWorkload
from fasttrain.profile.modules import ModuleTimer, exclusive, tensors_in
from fasttrain.profile.runner import OTHER, breakdown, hook_overhead, run_profile
from fasttrain.recipe import Recipe

DIM, VOCAB, SEQ = 32, 50, 8


@dataclass
class Hidden:
    """A block output that is a plain dataclass."""
    h: torch.Tensor
    note: str = "not a tensor"


class Output(OrderedDict):
    """Like transformers' ModelOutput: an OrderedDict whose fields are also attributes."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


class Embed(nn.Module):  # its input (token ids) needs no grad: its parameters end its backward
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)

    def forward(self, ids):
        return Hidden(self.tok(ids))


class DictBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: Hidden):
        return {"h": x.h + F.gelu(self.fc(x.h)), "mask": torch.ones(1)}


class TupleBlock(nn.Module):  # called with keywords, returns (tensor, None, int) like HF layers
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, hidden=None, scale=1.0):
        return hidden + F.gelu(self.fc(hidden)) * scale, None, 3


class OutputBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, h):
        y = self.fc(h)
        return Output(last_hidden_state=torch.tanh(y), hidden_states=(h, y))  # h passes through


class Mixed(nn.Module):
    """Every kind of block output; the head shares the embedding's weight (tied). ``remat``
    checkpoints the layers: their forward runs again, hooks and all, inside the backward."""

    def __init__(self, remat: bool = False):
        super().__init__()
        self.remat = remat
        self.embed = Embed()
        self.mix = DictBlock()
        self.layers = nn.ModuleList(TupleBlock() for _ in range(2))
        self.out = OutputBlock()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.tok.weight

    def forward(self, ids):
        h = self.mix(self.embed(ids))["h"]
        for layer in self.layers:
            h = (checkpoint(layer, hidden=h, scale=0.5, use_reentrant=False) if self.remat
                 else layer(hidden=h, scale=0.5))[0]
        return self.head(self.out(h).last_hidden_state)


BLOCKS = ("embed", "mix", "layers", "out", "head")


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"ids": torch.randint(0, VOCAB, (SEQ,), generator=g)}


def _lm_loss(model, b):
    logits = model(b["ids"][:, :-1])  # (B, T-1, V)
    return F.cross_entropy(logits.flatten(0, 1), b["ids"][:, 1:].flatten(), reduction="sum")


def _mixed_workload(remat: bool = False) -> SimpleWorkload:
    return SimpleWorkload(name="mixed", build=lambda: Mixed(remat), data=Tokens,
                          loss_fn=_lm_loss, default_batch=8)


def test_tensors_are_found_inside_any_output():
    a, b, c = torch.ones(1), torch.zeros(2), torch.ones(3)
    out = (Hidden(a), {"x": [b, 3, None]}, Output(y=c, cache=object()), "text")
    assert [t.shape for t in tensors_in(out)] == [a.shape, b.shape, c.shape]


def test_exclusive_time_never_counts_an_instant_twice():
    # outer 0-10 holds inner 2-5; a third span overlaps the outer's end (tied weights)
    got = exclusive([(0.0, 10.0, "outer"), (2.0, 5.0, "inner"), (8.0, 12.0, "late")])
    assert got == {"outer": 7.0 - 2.0, "inner": 3.0, "late": 4.0}
    assert sum(got.values()) == 12.0  # the union of the spans


def _drive(model: nn.Module, micro: int = 2) -> tuple[dict[str, float], float]:
    """One hooked step run by hand (``micro`` micro-batches): the timer's seconds per part and
    the wall time of the backward calls."""
    timer = ModuleTimer(active={0})
    timer.attach(SimpleNamespace(cuda=False, recipe=Recipe(), model=model))
    timer.begin(0)
    bwd = 0.0
    for _ in range(micro):
        loss = _lm_loss(model, {"ids": torch.randint(0, VOCAB, (4, SEQ))})
        t0 = time.perf_counter()
        loss.backward()
        bwd += time.perf_counter() - t0
    timer.end(0)
    # the hooks are gone: a plain step leaves nothing behind
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    return timer.report()["per_step"][0], bwd


@pytest.mark.parametrize("remat", [False, True], ids=["eager", "checkpointed"])
def test_every_block_gets_a_backward_span_whatever_it_returns(remat):
    seconds, bwd_wall = _drive(Mixed(remat))
    for block in BLOCKS:
        assert seconds.get(f"{block} fwd", 0) > 0, (block, seconds)
        assert seconds.get(f"{block} bwd", 0) > 0, (block, seconds)
    # exclusive spans inside the backward calls: together they never exceed them
    assert sum(v for k, v in seconds.items() if k.endswith(" bwd")) <= bwd_wall


def test_recomputed_forwards_are_backward_time_not_extra_forward_calls():
    model = Mixed(remat=True)
    timer = ModuleTimer(active={0})
    timer.attach(SimpleNamespace(cuda=False, recipe=Recipe(), model=model))
    timer.begin(0)
    with set_checkpoint_early_stop(False):  # the whole forward again, its post-hook too
        _lm_loss(model, {"ids": torch.randint(0, VOCAB, (4, SEQ))}).backward()
    timer.end(0)
    names = [c.name for c in timer.steps[0].calls]
    assert names == ["embed", "mix", "layers", "layers", "out", "head"]


def test_breakdown_rows_add_up_to_the_step_and_name_the_rest():
    phases = {"data": 1.0, "forward": 10.0, "backward": 20.0, "optimizer": 3.0, "other": 0.5}
    rows = breakdown(phases, {"a fwd": 6.0, "b fwd": 3.0, "a bwd": 25.0}, step=34.5)
    by = {r["part"]: r["s"] for r in rows}
    assert by["forward (rest)"] == pytest.approx(1.0)
    assert by["a bwd"] == pytest.approx(20.0) and "backward (rest)" not in by  # scaled to fit
    assert by[OTHER] == pytest.approx(0.5)
    assert sum(by.values()) == pytest.approx(34.5, rel=1e-12)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("plain, hooked, over, within", [
    ([10.0, 10.2, 9.9, 10.1], [10.05, 10.1, 10.0, 10.2], 0.0075, True),  # inside the A/A noise
    ([10.0, 10.1, 10.0, 10.1], [12.0, 12.1, 12.0, 12.1], 0.2, False),  # a real cost
    ([10.0, 10.1, 10.0, 10.1], [4.1, 4.0, 4.2, 4.1], 0.0, False),  # faster: drift, flagged
])
def test_hook_overhead_is_non_negative_and_says_when_it_is_noise(plain, hooked, over, within):
    got = hook_overhead(plain, hooked)
    assert got["overhead"] >= 0 and got["overhead"] == pytest.approx(over, abs=1e-3)
    assert got["within_noise"] is within
    if got["raw"] < -got["noise"]:
        assert "not measurable" in got["note"]
    elif within:
        assert "within" in got["note"]


def _check_profile(p: dict, blocks: tuple[str, ...]) -> None:
    parts = {r["part"]: r["s"] for r in p["breakdown"]}
    for block in blocks:
        assert parts.get(f"{block} bwd", 0) > 0, (block, parts)
        assert parts.get(f"{block} fwd", 0) > 0, (block, parts)
    assert p["profiling_overhead"] >= 0 and p["profiling_overhead_noise"] is not None
    assert "hook overhead" in p["modules_note"] or "not measurable" in p["modules_note"]
    # forward + backward + optimizer + ... + other = the (hooked, mean) step it claims
    assert sum(parts.values()) == pytest.approx(p["breakdown_step_s"], rel=1e-9)
    assert sum(r["share"] for r in p["breakdown"]) == pytest.approx(1.0, rel=1e-9)
    assert all(r["s"] >= 0 for r in p["breakdown"]) and OTHER in parts


@pytest.mark.parametrize("recipe", [Recipe(), Recipe(accumulation=2),
                                    Recipe(checkpointing="full")], ids=["k1", "k2", "remat"])
def test_profile_of_a_model_with_every_kind_of_block_output(recipe):
    p = run_profile(_mixed_workload(), recipe, "cpu", steps=2, warmup=1, active=1)
    assert recipe.checkpointing == "none" or "checkpointing of 2/2 blocks" in str(p["applied"])
    _check_profile(p, BLOCKS)


@pytest.mark.parametrize("task", ["BertModel", "BertForSequenceClassification"])
def test_profile_of_a_tiny_hugging_face_bert(task):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=16, num_labels=2)
    cls = getattr(transformers, task)

    def loss(model, b):
        if task == "BertModel":
            out = model(input_ids=b["ids"])  # a ModelOutput all the way down
            return out.last_hidden_state.pow(2).sum() + out.pooler_output.pow(2).sum()
        labels = b["ids"][:, 0] % 2
        return model(input_ids=b["ids"], labels=labels).loss * len(labels)

    wl = SimpleWorkload(name=task, build=lambda: cls(cfg), data=Tokens, loss_fn=loss,
                        default_batch=4)
    p = run_profile(wl, Recipe(), "cpu", steps=2, warmup=1, active=1)
    _check_profile(p, ("embeddings", "encoder", "pooler") if task == "BertModel"
                   else ("bert", "classifier"))
