import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    # No GPU: fasttrain's Triton kernels run in Triton's interpreter, in-process and in the
    # CLI subprocesses the tests start (the variable must be set before they are imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """Workload data goes to one temp cache per test session (written once, reused)."""
    root = tmp_path_factory.getbasetemp() / "fasttrain-cache"
    monkeypatch.setenv("FASTTRAIN_CACHE", str(root))
    yield


@pytest.fixture(autouse=True)
def _interpreted_optimizer_blocks(monkeypatch):
    """In Triton's interpreter each program is a pass of NumPy calls with a fixed cost, so the
    one-launch AdamW's ~1,400 programs a step over SD-tiny's weights took 15 s; with 16,384
    elements a block, 6. Tests of the kernel's own blocking set smaller blocks themselves
    (test_adamw.py's ``small_blocks``, and its clip-norm test for the norm's blocks); the GPU
    runs the default. Without triton installed the triton tests skip and this does nothing."""
    if (os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
            and importlib.util.find_spec("triton") is not None):
        from fasttrain.kernels import adamw

        monkeypatch.setitem(adamw.LAUNCH, "block", 16384)
        monkeypatch.setitem(adamw.NORM_LAUNCH, "block", 16384)
    yield


@pytest.fixture
def timm_without_torchvision(monkeypatch):
    """``import timm`` fails as timm installed without torchvision does."""
    import builtins
    import importlib
    import sys

    monkeypatch.delitem(sys.modules, "timm", raising=False)
    real_import = builtins.__import__

    def no_torchvision(name, *args, **kwargs):
        if name == "timm":
            raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchvision)
    real_import_module = importlib.import_module

    def import_module(name, package=None):
        if name == "timm":
            raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")
        return real_import_module(name, package)

    monkeypatch.setattr(importlib, "import_module", import_module)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Under pytest-xdist each worker takes its share of the cores (one each with -n auto).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
