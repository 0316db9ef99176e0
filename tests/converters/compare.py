"""What the converters' tests compare: a converted model's output, input gradient and every
parameter gradient against the library model's, each within a share of the reference's largest
magnitude; and a layer wrapped the way a LoRA library wraps one, which a conversion must not
lose."""
from __future__ import annotations

import torch
from torch import nn


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str = "") -> None:
    """Elementwise within ``rel`` of the reference tensor's largest magnitude."""
    scale = max(want.abs().max().item(), 1e-12)
    torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=rel * scale,
                               msg=lambda m: f"{what}: {m}")


def assert_same_function(a, b, rel: float, input_name: str = "input") -> None:
    """``a`` and ``b`` are (output, input gradient, {parameter name: gradient})."""
    (out_a, dx_a, g_a), (out_b, dx_b, g_b) = a, b
    assert g_a.keys() == g_b.keys()
    assert_close(out_a, out_b, rel, "output")
    assert_close(dx_a, dx_b, rel, f"{input_name} gradient")
    for n in g_b:
        assert_close(g_a[n], g_b[n], rel, n)


class LoraLike(nn.Module):
    """What a LoRA library puts in a linear layer's place: the layer plus a low-rank update."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, 2, bias=False)
        self.up = nn.Linear(2, base.out_features, bias=False)
        nn.init.normal_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))
