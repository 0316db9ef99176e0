"""The LM head's cross-entropy with the logits' gradient written by its own Triton kernel
(kernels/cross_entropy.py), in Triton's interpreter: the loss and both gradients against
fp64 full logits and against the plain path under bf16 autocast, ignored labels, a padded
vocabulary, rows longer than a block and not a multiple of it, no-grad, and bad input."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tests.interpreted import interpret, kernels_interpreted  # noqa: E402,F401

with kernels_interpreted():
    from fasttrain.kernels import cross_entropy as ce
    from fasttrain.kernels.cross_entropy import linear_cross_entropy_fused

from fasttrain.kernels.linear_cross_entropy import linear_cross_entropy_reference  # noqa: E402


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 32 columns: rows span several blocks and end in a partial one."""
    monkeypatch.setitem(ce.LAUNCH, "block", 32)


def _inputs(dtype, n=(2, 37), c=16, v=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (3 * torch.randn(*n, c, generator=g, dtype=dtype)).requires_grad_()
    w = torch.randn(v, c, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randint(0, v, n, generator=g)
    y[0, :5] = -100  # ignored positions (padding)
    y[1, 0], y[1, 1] = 0, v - 1  # the first and the last class
    return h, w, y


def _run(fn, h, w, y, scale=1.0):
    h.grad = w.grad = None
    loss = fn(h, w, y)
    (loss * scale).backward()  # a scale, as the loop's 1 / token count
    return loss.detach(), h.grad.clone(), w.grad.clone()


def _exact(h, w, y, vocab=None):
    logits = (h.double() @ w.double().t())[..., :vocab]
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum",
                           ignore_index=-100)


def test_matches_fp64_full_logits_with_its_gradients():
    h, w, y = _inputs(torch.float32)
    got = _run(linear_cross_entropy_fused, h, w, y, scale=0.25)
    want = _run(_exact, h, w, y, scale=0.25)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


def test_a_padded_vocabulary_leaves_the_padding_out():
    h, w, y = _inputs(torch.float32, v=101)
    padded = torch.cat([w.detach(), torch.zeros(27, 16)]).requires_grad_()  # 128 rows
    got = _run(lambda h, w, y: linear_cross_entropy_fused(h, w, y, vocab=101), h, padded, y)
    want = _run(lambda h, w, y: _exact(h, w, y, vocab=101), h, padded, y)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2][101:], torch.zeros(27, 16))  # padding rows: no gradient


def test_under_bf16_autocast_it_matches_the_plain_path():
    h, w, y = _inputs(torch.float32, n=(3, 29), v=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(linear_cross_entropy_fused, h, w, y, scale=1 / 80)
        want = _run(linear_cross_entropy_reference, h, w, y, scale=1 / 80)
    assert got[1].dtype == got[2].dtype == torch.float32  # the inputs' dtypes
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)  # loss: fp32 sums
    for a, b in zip(got[1:], want[1:]):  # gradients: bf16 rounding, at other places
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_bf16_weights_and_a_row_of_only_ignored_labels():
    h, w, y = _inputs(torch.bfloat16)
    y[1] = -100  # a whole sequence ignored
    got = _run(linear_cross_entropy_fused, h, w, y)
    want = _run(_exact, h, w, y)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-2, atol=1e-2)
    assert torch.equal(got[1][1], torch.zeros_like(got[1][1]))  # no label: no gradient
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a.double(), b.double(), rtol=3e-2,
                                   atol=3e-2 * b.abs().max().item())


def test_without_grad_it_is_the_plain_loss():
    h, w, y = _inputs(torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy_fused(h, w, y)
    torch.testing.assert_close(loss, linear_cross_entropy_reference(h, w, y).detach())


def test_bad_input_is_one_line():
    h, w, y = _inputs(torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy_fused(h, w[:, :8], y)
    with pytest.raises(ValueError, match="vocab 200 is not in 1..101"):
        linear_cross_entropy_fused(h, w, y, vocab=200)


def test_compiles_without_graph_breaks():
    h, w, y = _inputs(torch.float32)
    torch._dynamo.reset()
    fn = torch.compile(linear_cross_entropy_fused, backend="aot_eager", fullgraph=True)
    for a, b in zip(_run(fn, h, w, y, scale=0.5), _run(_exact, h, w, y, scale=0.5)):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


def test_a_frozen_weight_gets_no_weight_gradient_gemm():
    from torch.utils.flop_counter import FlopCounterMode

    h, w, y = _inputs(torch.float32)
    w.requires_grad_(False)
    one = 2 * h.shape[0] * h.shape[1] * h.shape[2] * w.shape[0]  # one (tokens x C x V) GEMM
    with FlopCounterMode(display=False) as counter:
        linear_cross_entropy_fused(h, w, y).backward()
    assert counter.get_total_flops() == 2 * one  # the logits and the hidden states' gradient


@pytest.mark.parametrize("dtype, width", [(torch.float32, 104), (torch.bfloat16, 104)])
def test_the_gradient_of_an_odd_width_has_aligned_rows(dtype, width):
    """101 columns: the gradient's rows start 16 bytes apart (so its GEMMs read aligned
    leading dimensions), its values as a contiguous one's."""
    logits = torch.randn(5, 101).to(dtype)
    labels = torch.tensor([0, 3, -100, 100, 7])
    loss, padded = torch.ops.fasttrain.ce_loss_grad(logits, labels, 101)
    assert padded.shape == (5, width)  # the whole buffer; its first 101 columns the gradient
    grad = padded[:, :101]
    want = torch.softmax(logits.float(), -1) - F.one_hot(labels.clamp(min=0), 101)
    want[2] = 0
    torch.testing.assert_close(grad.float(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), labels, reduction="none"))


def test_a_label_outside_the_vocabulary_gives_a_nan_loss_and_no_gradient():
    """A padded class (gemm_pad) or a stray id: the plain path asserts on the device; here the
    row's loss is NaN, so the run's loss says so, and the row gets no gradient."""
    logits = torch.randn(4, 16)
    labels = torch.tensor([3, 12, -7, -100])  # 12 is padding past vocab=10; -7 is no label
    loss, padded = torch.ops.fasttrain.ce_loss_grad(logits, labels, 10)
    assert loss[0].isfinite() and loss[1].isnan() and loss[2].isnan() and loss[3] == 0
    assert torch.equal(padded[1:], torch.zeros_like(padded[1:]))
    h, w, y = _inputs(torch.float32)
    y[1, 3] = 101  # one past the last class
    assert linear_cross_entropy_fused(h, w, y).isnan()
