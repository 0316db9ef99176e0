"""The ladder of a user's own workload: the rungs its model is offered (looked at on the meta
device) and the peer rung, the same model trained by a plain PyTorch loop."""
from __future__ import annotations

import math

import pytest

from fasttrain import Recipe, load_workload
from fasttrain.ladder.plain_peer import is_user_workload, plain_peer_job
from fasttrain.run.child import ChildSpec


def _has_convertible() -> bool:
    import fasttrain.converters

    return hasattr(fasttrain.converters, "convertible")


needs_convertible = pytest.mark.skipif(
    not _has_convertible(), reason="fasttrain.converters.convertible (used by ladder/traits.py "
    "to pick a user model's rungs) does not exist yet")


def _rungs(spec: str) -> list[str]:
    from fasttrain.ladder.rungs import build_ladder

    return [rung.name for rung, _ in build_ladder(load_workload(spec), None, Recipe())]


# 5: channels-last for a user's convolution network only
@needs_convertible
def test_channels_last_is_offered_to_a_user_conv_net():
    assert "channels-last" in _rungs("examples.cnn:make_workload")


@needs_convertible
@pytest.mark.parametrize("spec", [
    "examples.my_workload:make_workload",  # no convolution
    "examples.vit:make_workload",  # one patch convolution: not a convolution network
])
def test_channels_last_is_not_offered_without_conv_layers(spec):
    names = _rungs(spec)
    assert "channels-last" not in names
    assert names[0] == "fp32" and "compile" in names  # the plain rungs are all there


def test_the_fast_search_tries_a_plain_vits_patch_norm_and_stream_switches():
    """Built on the meta device, the plain ViT's pre-norm blocks cannot be checked, so they stay
    candidates; the search still tries the bf16 stream for them, and the patch and LayerNorm
    kernels of its converted layers."""
    from fasttrain.ladder.search import fast_axes

    axes = {(label, field, value) for label, field, value in
            fast_axes(load_workload("examples.vit:make_workload"))}
    assert ("bf16 stream", "stream_dtype", "bf16") in axes
    assert {("kernels patch", "kernels", "patch"), ("kernels layernorm", "kernels",
                                                    "layernorm")} <= axes
    mine = {label for label, _, _ in fast_axes(load_workload("examples.my_workload:make_workload"))}
    assert "bf16 stream" not in mine


# 6: the peer of a user workload is a plain loop over the same model
def _peer(workload: str, batch: int) -> dict:
    return plain_peer_job(ChildSpec(job="fasttrain.ladder.plain_peer:plain_peer_job",
                                    workload=workload, size="tiny", device="cpu", steps=2,
                                    warmup=1, batch=batch))


def test_plain_loop_peer_of_a_user_workload_is_a_peer_row():
    row = _peer("examples.my_workload:make_workload", batch=8)
    assert row["error"] is None, row["error"]
    assert row["kind"] == "peer" and row["batch"] == 8
    assert row["throughput_unit"] == "sample/s" and row["throughput"] > 0
    assert row["losses"] and all(math.isfinite(x) for x in row["losses"])


def test_plain_loop_peer_counts_tokens():
    row = _peer("examples.gpt:make_workload", batch=2)
    assert row["error"] is None, row["error"]
    assert row["throughput_unit"] == "tok/s"
    # tiny GPT: 64 tokens a sequence, no ignored label
    assert row["throughput"] * row["step_time_s"] == pytest.approx(2 * 64, rel=1e-6)


@pytest.mark.parametrize("spec, user", [
    ("examples.gpt:make_workload", True),
    ("examples.my_workload:make_workload", True),
    ("vit", False),
    ("timm:vit_base_patch16_224", False),
    ("hf:llama", False),
])
def test_is_user_workload(spec, user):
    assert is_user_workload(spec) is user
