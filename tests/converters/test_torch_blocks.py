"""The pre-norm block of a model of the user's own, recognised by its children (CPU; the Triton
kernels interpreted): the converted block gives the module's output and every gradient, plain
and fused, fp32 and bf16, with LayerNorms or RMSNorms; stacked in an nn.Sequential the blocks
run as one chain with the same result; the user's class, state dict and parameter objects
stay; a call with other arguments runs the user's forward; post-norm and parallel blocks fail
the self-check with the reason and keep their own forward; modules that only look alike (torch's
own layers, a fifth child, a parameter of the block's own) are passed over without a word."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

pytest.importorskip("triton")

from tests.converters.test_torch_nn import (BF16_REL, DTYPES, FUSED_REL, PLAIN_REL,  # noqa: E402
                                            assert_same, check_module, converted,
                                            forward_backward)
from tests.interpreted import interpret  # noqa: E402,F401  (fixture: kernels interpreted)

from fasttrain.converters import convert, convertible, registry  # noqa: E402
from fasttrain.converters.registry import Finder, structural  # noqa: E402
from fasttrain.converters.torch_blocks import PreNormBlock  # noqa: E402
from fasttrain.layers.blocks import ChainedBlocks  # noqa: E402
from fasttrain.layers.norm import LayerNorm, RMSNorm  # noqa: E402
from tests.converters.plain_models import PackedAttention, ViTBlock, randomise  # noqa: E402

WIDTH, HEADS = 24, 3


class RmsBlock(nn.Module):
    """A Llama-style block of one's own: RMSNorms, SDPA attention, a SiLU MLP of its own."""

    def __init__(self, dim: int = WIDTH, heads: int = HEADS):
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attention = PackedAttention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))

    def forward(self, x, scale: float = 1.0):
        h = x + scale * self.attention(self.attn_norm(x))
        return h + scale * self.ffn(self.ffn_norm(h))


class PostNorm(ViTBlock):
    def forward(self, x):
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.mlp(x))


class Parallel(ViTBlock):
    def forward(self, x):
        return x + self.attn(self.norm1(x)) + self.mlp(self.norm2(x))


class LayerScaled(ViTBlock):
    def __init__(self, dim: int = WIDTH, heads: int = HEADS):
        super().__init__(dim, heads)
        self.gamma = nn.Parameter(torch.full((dim,), 0.1))

    def forward(self, x):
        x = x + self.gamma * self.attn(self.norm1(x))
        return x + self.gamma * self.mlp(self.norm2(x))


class Stack(nn.Module):
    def __init__(self, block=ViTBlock, n: int = 3):
        super().__init__()
        self.blocks = nn.Sequential(*(block(WIDTH, HEADS) for _ in range(n)))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        return self.norm(self.blocks(x))


def tokens(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(2, 9, WIDTH, dtype=dtype)  # 9 tokens: not a power of two


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [ViTBlock, RmsBlock])
def test_pre_norm_block_matches_the_module(block, dtype):
    module = randomise(block(WIDTH, HEADS))
    twin = check_module(module, tokens(), dtype=dtype)
    assert isinstance(twin, PreNormBlock) and isinstance(twin, block)
    norm = LayerNorm if block is ViTBlock else RMSNorm
    parts = twin.parts()
    assert type(parts[0]) is norm and type(parts[2]) is norm
    assert parts[0].feeds_matmul and parts[2].feeds_matmul  # qkv and fc1 read them


@pytest.mark.parametrize("block", [ViTBlock, RmsBlock])
def test_blocks_in_a_sequential_run_as_one_chain(block):
    model = randomise(Stack(block))
    x = tokens()
    want = forward_backward(model, x)
    for fused in (False, True):
        twin, report = converted(model, fused)
        assert report.chained == 1 and type(twin.blocks) is ChainedBlocks
        assert report.converted["your pre-norm block"] == 3
        assert [b.hands_on() for b in twin.blocks] == [fused] * 3
        assert_same(forward_backward(twin, x), want, FUSED_REL if fused else PLAIN_REL)


def test_stream_in_bf16_from_the_first_block():
    model = randomise(Stack(ViTBlock))
    twin, _ = converted(model, True)
    blocks = nn.ModuleList(twin.blocks)  # as a loop over a ModuleList runs them: unchained
    for b in blocks:
        b.stream_dtype = torch.bfloat16
    x = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = x
        for b in blocks:
            got = b(got)
    assert got.dtype == torch.bfloat16
    want = x
    for b in model.blocks:
        want = b(want)
    assert_same([got.float()], [want], BF16_REL * 3)


def test_state_dict_class_and_parameters_stay():
    """Converted with the fused kernels (interpreted), the stack keeps its keys, parameter
    objects and classes, and its state dict gives a plain stack the same outputs (within the
    fused kernels' tolerance; seeded: the weights and tokens come from the global generator)."""
    torch.manual_seed(0)
    model = randomise(Stack(ViTBlock))
    keys, before = list(model.state_dict()), dict(model.named_parameters())
    convert(model, kernels="fused")
    assert list(model.state_dict()) == keys
    assert all(p is before[n] for n, p in model.named_parameters())
    assert all(isinstance(b, ViTBlock) for b in model.blocks)
    plain = Stack(ViTBlock)
    plain.load_state_dict(model.state_dict())
    x = tokens()
    assert_same([plain(x)], [model(x)], FUSED_REL)


def test_a_call_with_other_arguments_runs_the_users_forward(monkeypatch):
    module = randomise(RmsBlock())
    twin = copy.deepcopy(module)
    assert convert(twin)
    calls = []
    monkeypatch.setattr(RmsBlock, "forward", lambda self, x, scale=1.0: calls.append(scale) or x)
    x = tokens()
    assert twin(x, 0.5) is x and twin(x, scale=0.25) is x and calls == [0.5, 0.25]
    assert twin(x) is not x and calls == [0.5, 0.25]


@pytest.mark.parametrize("block", [PostNorm, Parallel])
def test_blocks_that_compute_something_else_stay_with_the_reason(block):
    model = randomise(block(WIDTH, HEADS))
    twin = copy.deepcopy(model)
    report = convert(twin)
    assert type(twin) is block and "your pre-norm block" not in report.converted
    lines = [ln for ln in report.skipped_lines() if ln.startswith("your pre-norm block")]
    assert len(lines) == 1 and "not a pre-norm block" in lines[0], report.skipped_lines()
    x = tokens()
    assert_same([twin(x)], [model(x)], PLAIN_REL)  # its norms and MLP converted one by one


def test_a_block_whose_norms_cannot_be_fused_stays_with_the_reason():
    model = ViTBlock(WIDTH, HEADS).double()
    report = convert(model)
    assert not isinstance(model, PreNormBlock)
    assert any(ln.startswith("your pre-norm block") and "torch.float64" in ln
               for ln in report.skipped_lines()), report.skipped_lines()


class FiveChildren(ViTBlock):
    def __init__(self, dim: int = WIDTH, heads: int = HEADS):
        super().__init__(dim, heads)
        self.drop = nn.Dropout(0.0)


@pytest.mark.parametrize("make", [
    lambda: LayerScaled(),  # a parameter of its own: not x + attn(norm1(x))
    lambda: FiveChildren(),
    lambda: nn.TransformerEncoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=0.0, norm_first=True,
                                       batch_first=True),  # torch's: its own converter's business
    lambda: nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH),
                          nn.Linear(WIDTH, WIDTH)),
])
def test_look_alikes_are_passed_over_without_a_word(make):
    report = convert(make())
    assert "your pre-norm block" not in report.converted
    assert not any(ln.startswith("your pre-norm block") for ln in report.skipped_lines())


def test_the_finder_names_the_block_converter_for_blocks_only():
    find = Finder(registry(), structural())
    assert find(ViTBlock(WIDTH, HEADS)).name == "your pre-norm block"
    assert find(RmsBlock()).name == "your pre-norm block"
    assert find(LayerScaled()) is None and find(FiveChildren()) is None
    assert find(nn.LayerNorm(WIDTH)).name == "torch LayerNorm"  # by class, as before
    assert convertible(Stack(ViTBlock))


# ----------------------------------------------------------------------------- what the check sees

def test_a_block_built_on_meta_is_refused_even_without_checks():
    """Without parameter values the structure is all there is: not enough to convert."""
    with torch.device("meta"):
        model = Stack(ViTBlock)
    for check in (True, False):
        twin = copy.deepcopy(model)
        report = convert(twin, check=check)
        assert not any(isinstance(b, PreNormBlock) for b in twin.blocks)
        assert any(ln.startswith("your pre-norm block") and "meta device" in ln
                   for ln in report.skipped_lines()), report.skipped_lines()


def test_check_false_still_checks_a_structural_match():
    model = randomise(PostNorm(WIDTH, HEADS))
    report = convert(model, check=False)
    assert not isinstance(model, PreNormBlock)
    assert any("not a pre-norm block" in ln for ln in report.skipped_lines())


class DropsInTraining(ViTBlock):
    def forward(self, x):
        x = x + F.dropout(self.attn(self.norm1(x)), 0.5, self.training)
        return x + self.mlp(self.norm2(x))


class SwappedNorms(ViTBlock):
    def forward(self, x):
        x = x + self.attn(self.norm2(x))
        return x + self.mlp(self.norm1(x))


class ZeroInitParallel(Parallel):
    def __init__(self, dim: int = WIDTH, heads: int = HEADS):
        super().__init__(dim, heads)
        nn.init.zeros_(self.attn.proj.weight)
        nn.init.zeros_(self.attn.proj.bias)


@pytest.mark.parametrize("make", [
    lambda: DropsInTraining(WIDTH, HEADS).eval(),  # the same in eval mode, not in training
    lambda: SwappedNorms(WIDTH, HEADS),  # the two norms are one function at their init
    lambda: ZeroInitParallel(),  # a zero projection hides where the attention branch goes
])
def test_what_only_shows_off_its_initial_state_is_found(make):
    model = make()
    report = convert(model)
    assert not isinstance(model, PreNormBlock)
    assert any("not a pre-norm block" in ln for ln in report.skipped_lines()), \
        report.skipped_lines()


class Checkpointed(ViTBlock):
    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


def test_a_block_that_checkpoints_itself_stays_with_the_reason():
    model = randomise(Checkpointed(WIDTH, HEADS))
    report = convert(model)
    assert not isinstance(model, PreNormBlock)
    assert any("checkpoints activations" in ln for ln in report.skipped_lines())


def test_the_stream_by_keyword_runs_the_users_forward():
    class Named(ViTBlock):
        def forward(self, hidden_states):
            return super().forward(hidden_states)

    model = randomise(Named(WIDTH, HEADS))
    twin = copy.deepcopy(model)
    assert convert(twin).converted["your pre-norm block"] == 1
    x = tokens()
    assert_same([twin(hidden_states=x), twin(x)], [model(x), model(x)], PLAIN_REL)


def test_forward_hooks_on_chained_blocks_see_each_blocks_output():
    model = randomise(Stack(ViTBlock))
    twin, report = converted(model, True)
    assert report.chained == 1
    seen = {"model": [], "twin": []}
    for name, m in (("model", model), ("twin", twin)):
        for b in m.blocks:
            b.register_forward_hook(lambda mod, args, out, name=name: seen[name].append(out))
    x = tokens()
    assert_same([twin(x)], [model(x)], FUSED_REL)
    assert len(seen["twin"]) == 3 and all(isinstance(o, torch.Tensor) for o in seen["twin"])
    assert_same(seen["twin"], seen["model"], FUSED_REL)


def test_a_converted_model_pickles_whole():
    """torch.save(model) of a model whose classes were made by the conversion."""
    import io

    model = randomise(Stack(ViTBlock))
    convert(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert type(back.blocks[0]) is type(model.blocks[0]) and isinstance(back.blocks[0], ViTBlock)
    x = tokens()
    assert_same([back(x)], [model(x)], PLAIN_REL)


class ReturnsTuple(ViTBlock):
    def forward(self, x):
        return (super().forward(x),)


class NeedsMask(ViTBlock):
    def forward(self, x, mask):
        return super().forward(x)


def test_a_block_returning_a_tuple_stays_with_the_reason():
    """Its caller reads a tuple (a library's block: GPT-2's returns one); the converted block
    would hand it a tensor."""
    model = randomise(ReturnsTuple(WIDTH, HEADS))
    report = convert(model)
    assert not isinstance(model, PreNormBlock)
    assert any("not a pre-norm block" in ln and "it returns tuple" in ln
               for ln in report.skipped_lines()), report.skipped_lines()


def test_a_block_that_needs_more_than_the_stream_is_passed_over():
    report = convert(NeedsMask(WIDTH, HEADS))
    assert "your pre-norm block" not in report.converted
    assert not any(ln.startswith("your pre-norm block") for ln in report.skipped_lines())


class MhaBlock(nn.Module):
    """A pre-norm block of the user's own around torch's nn.MultiheadAttention, which takes
    (query, key, value): the pattern's branch(x) cannot stand in for its call."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def test_a_block_around_multihead_attention_is_refused_with_its_reason():
    model = nn.Sequential(MhaBlock(), MhaBlock())
    x = torch.randn(2, 5, WIDTH)
    want = model(x)
    report = convert(model)
    assert not any(isinstance(b, PreNormBlock) for b in model)
    lines = [ln for ln in report.skipped_lines() if ln.startswith("your pre-norm block")]
    assert lines and all("branch 'attn' (MultiheadAttention) needs 3 inputs" in ln
                         for ln in lines), report.skipped_lines()
    torch.testing.assert_close(model(x), want)


def test_a_steps_printout_carries_the_refusal():
    """print(step) shows the warnings of its conversion, not only step.report()."""
    import fasttrain

    model = nn.Sequential(MhaBlock())
    x = torch.randn(2, 5, WIDTH)
    step = fasttrain.Step(model, {"lr": 1e-3}, lambda m, b: m(b).square().mean(), x)
    assert any("needs 3 inputs" in w for w in step.report()["warnings"])
    assert "warning: " in repr(step) and "needs 3 inputs" in repr(step)
