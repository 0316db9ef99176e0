"""Running fasttrain's Triton kernels in Triton's interpreter, on the CPU, inside pytest.

Triton decides interpreted or compiled when ``@triton.jit`` runs, i.e. when a kernel module is
imported, and reads the variable again while interpreted kernels run. A test module imports its
kernels inside :func:`kernels_interpreted` and takes the ``interpret`` fixture; outside them the
variable is restored, so that the rest of the session (Inductor's own Triton kernels on a GPU,
say) is not interpreted.
"""
from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch


@contextlib.contextmanager
def kernels_interpreted():
    """Import kernel modules inside; skips the test module where the kernels must stay compiled.

    Triton fixes interpreted or compiled when a kernel module is first imported, for the whole
    process. On a machine with CUDA (the GPU suite, ``-m gpu``) an interpreted import here would
    leave every later test running the interpreter on host copies of CUDA tensors, which crashed
    the one-launch AdamW's GPU test with a segmentation fault; so these modules are skipped
    there before they import anything (run them where there is no GPU, or with
    ``TRITON_INTERPRET=1`` set for the whole session)."""
    done = sys.modules.get("fasttrain.kernels._triton")
    if (torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1") or (
            done is not None and not done.INTERPRETED):
        pytest.skip("Triton-interpreter tests: they run without a GPU (the GPU suite compiles "
                    "the kernels)", allow_module_level=True)
    before = os.environ.get("TRITON_INTERPRET")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
    from fasttrain.kernels import _triton
    if not _triton.INTERPRETED:
        pytest.skip("fasttrain.kernels was imported before TRITON_INTERPRET=1 was set",
                    allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def interpret():
    """Interpreted kernels read the variable while they run: set it for the whole module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        yield


def assert_compiled_matches_eager(fn, leaves: list[torch.Tensor], tol: float = 1e-5) -> None:
    """``torch.compile(fn, fullgraph=True)`` (aot_eager: no graph break around the kernels'
    custom ops) gives the eager scalar and the eager gradients of every leaf."""
    torch._dynamo.reset()
    results = []
    for f in (torch.compile(fn, backend="aot_eager", fullgraph=True), fn):
        args = [t.clone().requires_grad_() for t in leaves]
        out = f(*args)
        out.backward()
        results.append([out.detach(), *(a.grad for a in args)])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
