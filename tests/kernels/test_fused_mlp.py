"""The narrow MLP's forward kernel (kernels/fused_mlp.py) against its PyTorch reference in
Triton's interpreter on CPU: widths, dtypes, both GELUs, with and without fc2's bias, ragged
row counts; bad input; and fasttrain's Mlp switched to it giving the same output."""
import re

import pytest
import torch

pytest.importorskip("triton")

from tests.interpreted import kernels_interpreted  # noqa: E402

with kernels_interpreted():
    from fasttrain.kernels.fused_mlp import fits, mlp, mlp_reference

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _weights(c, hid, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(hid, c, generator=g) / c ** 0.5).to(dtype)
    b1 = (0.1 * torch.randn(hid, generator=g)).to(dtype)
    w2 = (torch.randn(n, hid, generator=g) / hid ** 0.5).to(dtype)
    b2 = (0.1 * torch.randn(n, generator=g)).to(dtype)
    return w1, b1, w2, b2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows, c, hid, n, with_b2, approximate", [
    (37, 32, 128, 32, True, "none"),  # ragged rows (not a multiple of the row block)
    (130, 16, 64, 64, False, "tanh"),  # output wider than input, no fc2 bias
    (8, 64, 192, 16, True, "tanh"),  # hidden: three chunks
])
def test_matches_the_reference(dtype, rows, c, hid, n, with_b2, approximate):
    w1, b1, w2, b2 = _weights(c, hid, n, dtype)
    x = torch.randn(2, rows, c, generator=torch.Generator().manual_seed(1)).to(dtype)
    b2 = b2 if with_b2 else None
    got = mlp(x, w1, b1, w2, b2, approximate)
    assert got.shape == (2, rows, n) and got.dtype == dtype
    torch.testing.assert_close(got, mlp_reference(x, w1, b1, w2, b2, approximate), **TOL[dtype])


def test_no_rows_give_no_rows():
    w1, b1, w2, b2 = _weights(16, 64, 16, torch.float32)
    assert mlp(torch.empty(0, 16), w1, b1, w2, b2).shape == (0, 16)


@pytest.mark.parametrize("dims, fit", [((128, 512, 128), True), ((256, 1024, 256), True),
                                       ((512, 2048, 512), False), ((96, 384, 96), False),
                                       ((128, 100, 128), False), ((768, 3072, 768), False)])
def test_which_widths_fit(dims, fit):
    assert fits(*dims) is fit


def _bad(**over):
    w1, b1, w2, b2 = _weights(16, 64, 16, torch.float32)
    args = dict(x=torch.randn(4, 16), w1=w1, b1=b1, w2=w2, b2=b2, approximate="none")
    args.update(over)
    return args


@pytest.mark.parametrize("over, message", [
    (dict(w1=torch.randn(64, 8)), "do not chain"),
    (dict(b1=torch.randn(3)), "b1 must be (64,)"),
    (dict(b2=torch.randn(3)), "b2 (16,) or None"),
    (dict(x=torch.randn(4, 16, dtype=torch.float64)), "one float dtype"),
    (dict(x=torch.randn(4, 24), w1=torch.randn(64, 24)), "do not fit the kernel"),
    (dict(approximate="fast"), "approximate must be"),
    (dict(x=torch.randn(4, 16, requires_grad=True)), "forward only"),
], ids=["chain", "b1", "b2", "dtype", "widths", "approximate", "grad"])
def test_bad_input_is_a_one_line_value_error(over, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        mlp(**_bad(**over))
    assert "\n" not in str(err.value)
