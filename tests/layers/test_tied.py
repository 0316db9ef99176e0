"""layers.tied: the tied lookup gives the rows and the weight's gradient of using the weight
twice (the embedding and the output layer), eager and compiled; in 16 bits nearer the fp64
gradient than the plain path; with an expanded or zero head gradient and with no ids; its row
adds equal an fp64 scatter-add with repeated ids, more ids than rows, and 3-D ids; ``ties``
accepts only a plain, hook-free lookup of the output layer's own weight."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fasttrain.layers.tied import add_rows, ties, tied_lookup


def ids_with_repeats(shape: tuple[int, ...], vocab: int, seed: int = 0) -> torch.Tensor:
    """Random ids with one id (7, or the last row) taking a third of the positions, a frequent
    token, and id 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, shape, generator=g)
    flat = ids.view(-1)
    flat[: flat.numel() // 3] = min(7, vocab - 1)
    flat[-1] = 0
    return ids


def loss_of(weight: torch.Tensor, ids: torch.Tensor, tied: bool) -> torch.Tensor:
    """Embedding → a nonlinearity → the output layer on the same weight → cross-entropy."""
    x, head = tied_lookup(weight, ids) if tied else (F.embedding(ids, weight), weight)
    h = torch.tanh(x.float() * 1.5).to(weight.dtype)
    logits = (h @ head.t()).float()
    return F.cross_entropy(logits.flatten(0, -2), ids.flatten())


def weight_grad(weight: nn.Parameter, fn, *args) -> torch.Tensor:
    weight.grad = None
    fn(weight, *args).backward()
    return weight.grad.clone()


@pytest.mark.parametrize("shape", [(3, 50), (2, 3, 17)])
def test_tied_lookup_gives_the_rows_and_the_gradient_of_the_weight_used_twice(shape):
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(300, 16))
    ids = ids_with_repeats(shape, 300)
    rows, head = tied_lookup(weight, ids)
    assert torch.equal(rows, F.embedding(ids, weight)) and head.shape == weight.shape
    want = weight_grad(weight, loss_of, ids, False)
    got = weight_grad(weight, loss_of, ids, True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    assert got[7].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_tied_gradient_is_nearer_fp64_than_the_plain_paths(dtype):
    """In 16 bits, against the fp64 gradient of the same rounded forward: the frequent token's
    rows summed in fp32 (the plain CPU path adds them in 16 bits one by one)."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(300, 16).to(dtype))
    ids = ids_with_repeats((3, 50), 300)
    exact = nn.Parameter(weight.detach().double())
    want = weight_grad(exact, loss_of, ids, False)
    scale = want.abs().max().item()
    tied = (weight_grad(weight, loss_of, ids, True).double() - want).abs().max().item()
    plain = (weight_grad(weight, loss_of, ids, False).double() - want).abs().max().item()
    assert tied <= 2e-2 * scale and tied <= plain, (tied, plain, scale)


def test_an_unused_or_expanded_head_gradient_and_no_ids():
    """The head's gradient may arrive expanded (a sum of the head) or as zeros (the head
    unused); no ids give the head's gradient alone."""
    weight = nn.Parameter(torch.randn(5, 3))
    ids = torch.tensor([[1, 1, 4]])
    rows, head = tied_lookup(weight, ids)
    (rows.sum() + head.sum()).backward()
    want = torch.ones(5, 3)
    want[1] += 2
    want[4] += 1
    assert torch.equal(weight.grad, want)
    weight.grad = None
    tied_lookup(weight, ids)[0].sum().backward()
    assert torch.equal(weight.grad, want - 1)
    weight.grad = None
    rows, head = tied_lookup(weight, torch.zeros(0, dtype=torch.long))
    assert rows.shape == (0, 3)
    (rows.sum() + 2 * head.sum()).backward()
    assert torch.equal(weight.grad, torch.full((5, 3), 2.0))


def test_compiled_tied_lookup_gives_the_eager_gradient():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(300, 16))
    ids = ids_with_repeats((3, 50), 300)
    want = weight_grad(weight, loss_of, ids, True)
    got = weight_grad(weight, torch.compile(loss_of, backend="inductor"), ids, True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("vocab, n", [(300, 150), (5, 40), (64, 64)])
def test_add_rows_equals_an_fp64_scatter_add(vocab, n):
    """Repeated ids; more ids than rows (the spare slots wrap round the vocabulary)."""
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(vocab, 8, generator=g)
    ids = ids_with_repeats((n,), vocab, seed=2)
    rows = torch.randn(n, 8, generator=g)
    want = dense.double().index_add(0, ids, rows.double())
    got = add_rows(dense, ids, rows)
    assert got.dtype == dense.dtype and got.data_ptr() != dense.data_ptr()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_add_rows_in_bf16_rounds_each_row_once_after_an_fp32_sum():
    """A frequent id's many small rows: their fp32 sum added once, not rounded add by add."""
    dense = torch.zeros(4, 2, dtype=torch.bfloat16)
    ids = torch.full((1000,), 2)
    rows = torch.full((1000, 2), 1e-3, dtype=torch.bfloat16)
    got = add_rows(dense, ids, rows)
    assert torch.equal(got[2], torch.full((2,), 1000 * float(rows[0, 0]),
                                          dtype=torch.float32).to(torch.bfloat16))
    assert torch.equal(got[[0, 1, 3]], dense[[0, 1, 3]])


def test_ties_only_a_plain_lookup_of_the_heads_own_weight():
    emb = nn.Embedding(10, 4)
    assert ties(emb, emb.weight)
    assert not ties(emb, nn.Parameter(emb.weight.detach().clone()))
    for kwargs in (dict(padding_idx=0), dict(max_norm=1.0), dict(scale_grad_by_freq=True),
                   dict(sparse=True)):
        other = nn.Embedding(10, 4, **kwargs)
        assert not ties(other, other.weight), kwargs

    class Scaled(nn.Embedding):  # a subclass may change the lookup
        pass

    scaled = Scaled(10, 4)
    assert not ties(scaled, scaled.weight)
    hooked = nn.Embedding(10, 4)
    handle = hooked.register_forward_hook(lambda m, i, o: o * 0)
    assert not ties(hooked, hooked.weight)  # its forward would be skipped
    handle.remove()
    assert ties(hooked, hooked.weight)
