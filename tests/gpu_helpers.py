"""Checks that several GPU test modules share (tests/kernels/*_gpu.py): imports only torch and
fasttrain's loop, safe on a CPU machine; the kernels are imported by the tests themselves."""
import torch

from fasttrain.recipe import Recipe
from fasttrain.run.loop import train
from fasttrain.workloads import load_workload


def compiled_and_reference(fused, reference, inputs, loss, rel: float = 2e-2):
    """The outputs of ``fn(*inputs)`` and the gradients of ``loss`` of them, for fused compiled
    by inductor (the Triton path the CPU tests cannot run) and for the plain reference, agree
    elementwise to ``rel`` of each tensor's largest magnitude (bf16 rounds differently)."""
    results = []
    torch._dynamo.reset()
    for fn in (torch.compile(fused, fullgraph=True), reference):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*leaves)
        loss(out).backward()
        outs = out if isinstance(out, tuple) else (out,)
        results.append([o.detach().float() for o in outs] +
                       [t.grad.float() for t in leaves if t.requires_grad])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=rel, atol=rel * want.abs().max().item())


def kernels_keep_the_losses(workload: str, base: Recipe, kernels: tuple[str, ...],
                             says: str) -> None:
    """Each ``kernels`` setting on top of ``base`` (compiled, bf16 autocast) trains the tiny
    workload with the plain run's losses (bf16 tolerance), says ``says``, warns of nothing."""
    wl = load_workload(workload, "tiny")
    plain = train(wl, base, steps=4, warmup=0, device="cuda")
    for k in kernels:
        fused = train(wl, base.replace(kernels=k), steps=4, warmup=0, device="cuda")
        assert says in fused.applied["kernels"] and not fused.warnings
        torch.testing.assert_close(torch.tensor(fused.losses), torch.tensor(plain.losses),
                                   rtol=2e-2, atol=0)

