"""Every switch says what it did or why it did nothing: asked for where it matches nothing (a
CNN without attention, a CPU without TF32), a technique records *no effect* with the reason in
the run's ``no_effect`` (and a warning naming it), so the ladder does not credit it with noise."""
import pytest
import torch

from fasttrain.recipe import Recipe
from fasttrain.run.loop import train
from fasttrain.techniques import registry, technique_of
from fasttrain.techniques.base import TrainState
from tests.helpers import tiny_cnn_workload

IDLE = {  # technique → (switches that ask for it, words of the reason), on the tiny CNN, CPU
    "allocator": ({"allocator": "expandable"}, "CUDA only"),
    "convert": ({"convert": True}, "no module fasttrain converts"),
    "precision": ({"precision": "tf32"}, "tf32 has no effect on CPU"),
    "stream_dtype": ({"precision": "bf16-mixed", "stream_dtype": "bf16"}, "no residual stream"),
    "attention": ({"attention": "auto"}, "no scaled_dot_product_attention call seen"),
    "kernels": ({"kernels": "fused"}, "no fused path switched on"),
    "fp8": ({"precision": "bf16-mixed", "fp8": "linear"}, "no trainable nn.Linear"),
    "gemm_pad": ({"gemm_pad": 8}, "nothing padded"),
    "checkpointing": ({"checkpointing": "full"}, "no repeated trainable blocks"),
    "sharding": ({"sharding": "ddp"}, "single process"),
    "dataloader": ({"pin_memory": True, "device_prefetch": True}, "CUDA copies only"),
    "padding": ({"pad_multiple": 8}, "no variable-length fields"),
}
NEVER_IDLE = {  # technique → why it always changes something when asked for
    "init": "host or device: other initial weights either way",
    "channels_last": "idles on a model without Conv2d: test_channels_last_idles_without_conv",
    "compile": "a model without repeated blocks is compiled whole",
    "optimizer": "always builds the optimizer (master_weights idles under its own name)",
    "ema": "an EMA asked for is kept (and saved), on any workload",
    "cuda_graphs": "refused on a CPU before it runs (needs CUDA)",
    "graph_memset_kernels": "refused on a CPU before it runs (needs CUDA)",
    "accumulation": "always splits the batch",
}


def test_every_technique_decides_whether_it_can_have_no_effect():
    """Generated from the registry: a new technique must say where it idles, or why never."""
    names = {t.name for t in registry()}
    assert names == IDLE.keys() | NEVER_IDLE.keys()
    assert not IDLE.keys() & NEVER_IDLE.keys()


@pytest.mark.parametrize("name", sorted(IDLE))
def test_a_technique_that_matched_nothing_says_so(name):
    switches, words = IDLE[name]
    res = train(tiny_cnn_workload(), Recipe(**switches), steps=1, warmup=0)
    assert words in res.no_effect.get(name, ""), res.no_effect
    assert any(w.startswith(f"{name}:") for w in res.warnings), res.warnings
    # its own switches map back to it (the ladder marks a rung through this)
    assert name in {technique_of(f) for f in switches}


def test_a_technique_that_acted_is_not_idle():
    res = train(tiny_cnn_workload(), Recipe(channels_last=True, precision="bf16-mixed",
                                            attention="math", pin_memory=True, workers=1),
                steps=1, warmup=0)
    assert res.no_effect == {}, res.no_effect


def test_channels_last_idles_without_conv():
    from examples.my_workload import make_workload

    res = train(make_workload(), Recipe(channels_last=True), steps=1, warmup=0)
    assert "no Conv2d" in res.no_effect["channels_last"]


def test_inductor_switches_left_off_idle_under_their_own_names():
    from fasttrain.techniques import compile as compile_tech

    wl = tiny_cnn_workload()
    model = wl.build_model()
    state = TrainState(recipe=Recipe(compile="model", compile_backend="aot_eager", pdl=True,
                                     combo_kernels=True, autotune_reductions=True),
                       workload=wl, device=torch.device("cpu"), model=model, trainable=model,
                       micro_batch=2)
    compile_tech.apply(state)
    state.restore.close()
    torch._dynamo.reset()
    assert set(state.no_effect) == {"pdl", "combo_kernels", "autotune_reductions"}
    assert all("needs the inductor backend" in why for why in state.no_effect.values())


def test_more_workers_than_cpus_are_capped_and_said(monkeypatch):
    """workers=8 of a GPU recipe on a 2-core machine: 2 loader processes and a warning, not
    torch's warning and eight processes fighting the training one."""
    from fasttrain.techniques import dataloader

    monkeypatch.setattr(dataloader, "_cpus", lambda: 2)
    res = train(tiny_cnn_workload(), Recipe(workers=8), steps=1, warmup=0)
    assert "dataloader: workers=8 on a machine of 2 CPUs; using 2" in res.warnings
    assert res.applied["dataloader"].startswith("2 workers"), res.applied
