"""The converter examples in ``examples/``: each trains its (tiny) public model in the user's own
loop, under Hugging Face's Trainer, Lightning or Accelerate, converted and not, and the
converted run reports what it converted and trains with the same losses (CPU: the plain path,
the same maths). Each skips where its library is not installed."""
from __future__ import annotations

import importlib

import pytest

from tests.converters.timm_stub import import_timm

VIT_TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10)


def _example(name: str, *libraries: str):
    for lib in libraries:
        if lib == "timm":
            if import_timm() is None:
                pytest.skip("timm is not installed")
        else:
            pytest.importorskip(lib)
    return importlib.import_module(f"examples.{name}")


def _same_losses(example, says: str, **kwargs) -> None:
    plain, _ = example.main(convert=False, **kwargs)
    converted, report = example.main(convert=True, **kwargs)
    assert says in report, report
    assert len(converted) == len(plain) == kwargs["steps"]
    assert converted == pytest.approx(plain, rel=1e-5)


def test_own_loop_example():
    """A plain PyTorch loop over a timm ViT: converted, the same losses."""
    example = _example("convert_own_loop", "timm")
    _same_losses(example, "timm ViT Block ×2", steps=2, batch=2, device="cpu", **VIT_TINY)


def test_lightning_example():
    """lightning.Trainer over a timm ViT converted inside the LightningModule."""
    example = _example("convert_lightning", "timm", "lightning")
    _same_losses(example, "timm ViT Block ×2", steps=2, batch=2, **VIT_TINY)


def test_hf_trainer_example():
    """transformers.Trainer over a converted tiny Llama (batches without attention masks)."""
    example = _example("convert_hf_trainer", "transformers", "accelerate")
    _same_losses(example, "transformers DecoderLayer ×2", steps=2)


def test_accelerate_example():
    """Accelerator.prepare over a converted tiny Llama."""
    example = _example("convert_accelerate", "transformers", "accelerate")
    _same_losses(example, "transformers DecoderLayer ×2", steps=2)
