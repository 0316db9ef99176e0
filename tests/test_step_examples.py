"""The ``fasttrain.Step`` examples in ``examples/``: each trains with the Step and without it
and gets the same losses (CPU: the Step's CPU recipe is the plain loop's fp32 maths)."""
from __future__ import annotations

import importlib

import pytest


def test_own_loop_step_example():
    example = importlib.import_module("examples.step_own_loop")
    plain, _ = example.main(steps=4, use_step=False, device="cpu")
    stepped, report = example.main(steps=4, use_step=True, device="cpu")
    assert "your pre-norm block ×2; torch LayerNorm ×1" in report and "yours: AdamW" in report
    assert stepped == pytest.approx(plain, rel=1e-5)


def test_lightning_step_example():
    pytest.importorskip("lightning")
    example = importlib.import_module("examples.step_lightning")
    plain, _ = example.main(steps=3, use_step=False)
    stepped, report = example.main(steps=3, use_step=True)
    assert len(stepped) == len(plain) == 3
    assert "yours: AdamW" in report
    assert stepped == pytest.approx(plain, rel=1e-5)


def test_hf_trainer_step_example():
    """The Trainer keeps its loop and scheduler; the Step trains (a large learning rate makes a
    step that did not train visible in the losses)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    example = importlib.import_module("examples.step_hf_trainer")
    plain, _ = example.main(steps=3, use_step=False, lr=0.05)
    stepped, report = example.main(steps=3, use_step=True, lr=0.05)
    assert "transformers DecoderLayer ×2" in report and "yours: AdamW" in report
    assert stepped == pytest.approx(plain, rel=1e-5)
    assert abs(plain[2] - plain[0]) > 0.1  # it trained


def test_the_example_recipes_are_steps_default_plus_the_loader():
    """examples/recipes/fast.toml is fasttrain.Step's default with the loader's switches and the
    bf16 residual stream; the conv variant has channels-last instead of the stream."""
    from pathlib import Path

    from fasttrain.recipe import load_toml
    from fasttrain.run.step import DEFAULT

    here = Path(__file__).resolve().parents[1] / "examples" / "recipes"
    fast, conv = load_toml(here / "fast.toml"), load_toml(here / "fast-conv.toml")
    loader = {"workers", "pin_memory", "non_blocking", "device_prefetch"}
    differs = {k for k, v in fast.to_dict().items() if v != DEFAULT.to_dict()[k]}
    assert differs == loader | {"stream_dtype"} and fast.stream_dtype == "bf16"
    assert {k for k, v in conv.to_dict().items() if v != fast.to_dict()[k]} == {
        "channels_last", "stream_dtype"}
