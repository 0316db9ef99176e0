"""Each technique does what it claims, on the tiny workloads, on CPU."""
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fasttrain.errors import FasttrainError
from fasttrain.recipe import Recipe
from fasttrain.run.loop import prepare, train
from fasttrain.measure.parity import compare
from fasttrain.techniques import registry, unmet_requirements
from fasttrain.techniques import attention as attn
from fasttrain.techniques.ema import Ema
from fasttrain.workloads import REGISTRY, load_workload

CPU = torch.device("cpu")


def _optimizer_ops(impl: str) -> set[str]:
    wl = load_workload("vit", "tiny")
    state, _, _ = prepare(wl, Recipe(optimizer_impl=impl), CPU)
    for p in state.trainable.parameters():
        p.grad = torch.randn_like(p)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        state.optimizer.step()
    return {e.name for e in prof.events()}


def test_fused_optimizer_is_really_fused():
    assert "aten::_fused_adamw_" in _optimizer_ops("fused")
    foreach = _optimizer_ops("foreach")
    assert "aten::_fused_adamw_" not in foreach and any(n.startswith("aten::_foreach_") for n in foreach)
    loop = _optimizer_ops("forloop")
    assert not any(n.startswith("aten::_foreach_") or n == "aten::_fused_adamw_" for n in loop)


@pytest.mark.parametrize("mode", ["foreach", "side-stream"])
def test_ema_modes_equal_the_plain_ema(mode):
    torch.manual_seed(0)
    params = [torch.randn(5, 3), torch.randn(7)]
    plain, other = Ema(params, 0.9, "per-tensor"), Ema(params, 0.9, mode if mode != "side-stream" else "foreach")
    for _ in range(3):
        for p in params:
            p.add_(torch.randn_like(p))
        plain.update()
        other.update()
    for a, b in zip(plain.shadow, other.shadow):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_side_stream_ema_falls_back_on_cpu_and_says_so():
    res = train(load_workload("vit", "tiny"), Recipe(ema="side-stream"), steps=2, warmup=0)
    assert "foreach" in res.applied["ema"]
    assert any("side-stream needs CUDA" in w for w in res.warnings)


def test_accumulation_equals_one_big_batch():
    wl = load_workload("vit", "tiny")
    big = train(wl, Recipe(batch=8), steps=4, warmup=0)
    acc = train(wl, Recipe(batch=8, accumulation=4), steps=4, warmup=0)
    assert acc.batch == big.batch == 8
    torch.testing.assert_close(torch.tensor(acc.losses), torch.tensor(big.losses), rtol=1e-5, atol=0)


def test_accumulation_on_tokens_normalises_by_token_count():
    wl = load_workload("llama", "tiny")
    big = train(wl, Recipe(batch=4), steps=3, warmup=0)
    acc = train(wl, Recipe(batch=4, accumulation=2), steps=3, warmup=0)
    torch.testing.assert_close(torch.tensor(acc.losses), torch.tensor(big.losses), rtol=1e-5, atol=0)


def test_regional_compile_compiles_each_distinct_block_once():
    torch._dynamo.reset()
    wl = load_workload("vit", "tiny")  # two identical blocks
    res = train(wl, Recipe(compile="regional", compile_backend="eager"), steps=2, warmup=1)
    assert "regional: 2 blocks" in res.applied["compile"]
    assert res.compile["unique_graphs"] == 1 and res.compile["recompiles"] == 0


def test_whole_model_compile_keeps_fp32_parity():
    torch._dynamo.reset()
    wl = load_workload("vit", "tiny")
    ref = train(wl, Recipe(), steps=3, warmup=0)
    comp = train(wl, Recipe(compile="model", compile_backend="aot_eager"), steps=3, warmup=0)
    torch.testing.assert_close(torch.tensor(comp.losses), torch.tensor(ref.losses), rtol=1e-4, atol=0)


def test_launch_switches_set_inductors_flags_for_the_run_only_or_say_why_not():
    import torch._inductor.config as inductor_config

    from fasttrain.techniques import compile as compile_tech
    from fasttrain.techniques.base import TrainState

    wl = load_workload("vit", "tiny")
    model = wl.build_model()
    before = (inductor_config.triton.enable_pdl, inductor_config.combo_kernels)

    def state(**switches):
        return TrainState(recipe=Recipe(compile="model", pdl=True, combo_kernels=True,
                                        **switches),
                          workload=wl, device=torch.device("cpu"), model=model,
                          trainable=model, micro_batch=2)

    cpu = state()  # combo kernels are Inductor's on any device; PDL needs a Hopper GPU
    assert compile_tech.apply(cpu).endswith("; combo kernels")
    assert cpu.warnings == ["pdl: needs a GPU of compute capability 9.0 or newer, not cpu; "
                            "left off"]
    assert (inductor_config.triton.enable_pdl, inductor_config.combo_kernels) == (before[0], True)
    cpu.restore.close()  # the run's end
    assert (inductor_config.triton.enable_pdl, inductor_config.combo_kernels) == before
    debug = state(compile_backend="aot_eager")
    assert "combo" not in compile_tech.apply(debug)
    assert debug.warnings == ["pdl: needs the inductor backend; left off",
                              "combo_kernels: needs the inductor backend; left off"]
    assert (inductor_config.triton.enable_pdl, inductor_config.combo_kernels) == before
    torch._dynamo.reset()


def test_autotune_reductions_sets_inductors_flag_for_the_run_only():
    import torch._inductor.config as inductor_config

    from fasttrain.techniques import compile as compile_tech
    from fasttrain.techniques.base import TrainState

    wl = load_workload("vit", "tiny")
    model = wl.build_model()
    flag = "mix_order_reduction_autotune_split_size"
    before = getattr(inductor_config.triton, flag)

    def state(**switches):
        return TrainState(recipe=Recipe(compile="model", autotune_reductions=True, **switches),
                          workload=wl, device=torch.device("cpu"), model=model,
                          trainable=model, micro_batch=2)

    tuned = state()
    assert compile_tech.apply(tuned).endswith("; mix-order reduction split sizes autotuned")
    assert getattr(inductor_config.triton, flag) is True
    tuned.restore.close()  # the run's end
    assert getattr(inductor_config.triton, flag) == before
    debug = state(compile_backend="aot_eager")  # no Inductor kernels to tune: says so
    assert "autotuned" not in compile_tech.apply(debug)
    assert debug.warnings == ["autotune_reductions: needs the inductor backend; left off"]
    assert getattr(inductor_config.triton, flag) == before
    torch._dynamo.reset()


def test_channels_last_warns_when_nothing_to_convert():
    from examples.my_workload import make_workload

    res = train(make_workload(), Recipe(channels_last=True), steps=1, warmup=0)
    assert any("no Conv2d" in w for w in res.warnings)


def test_cuda_graphs_on_cpu_is_a_clear_error():
    with pytest.raises(FasttrainError, match="cuda_graphs needs CUDA"):
        train(load_workload("vit", "tiny"), Recipe(cuda_graphs=True), steps=1, warmup=4)


def test_attention_verdict_reports_fallback():
    from collections import Counter

    line, fell = attn.verdict("flash", Counter({"math": 4}), {("q",): "attn_mask not supported"})
    assert fell and "fell back to math: attn_mask not supported" in line
    line, fell = attn.verdict("auto", Counter({"flash": 4}), {})
    assert not fell and line == "ran flash x4"


def test_attention_backend_is_applied_and_checked():
    res = train(load_workload("vit", "tiny"), Recipe(attention="flash"), steps=1, warmup=0)
    assert "ran flash (cpu)" in res.applied["attention"]
    res = train(load_workload("vit", "tiny"), Recipe(attention="math"), steps=1, warmup=0)
    assert "ran math" in res.applied["attention"]


def test_technique_cards_are_complete():
    names = [t.name for t in registry()]
    assert len(names) == len(set(names))
    for t in registry():
        assert t.summary and isinstance(t.changes_numerics, bool)


def _smoke_recipe(tech, workload) -> Recipe:
    """The card's example on the tiny workload: small batches where Triton kernels run
    interpreted, a doubled global batch for accumulation (same micro-batch as the baseline)."""
    recipe = Recipe().replace(**tech.example)
    if tech.name == "kernels":
        recipe = recipe.replace(batch=2)
    if recipe.accumulation > 1:
        recipe = recipe.replace(batch=workload.default_batch * recipe.accumulation)
    return recipe


_BASELINES: dict[tuple[str, int | None], list[float]] = {}


def _baseline(name: str, batch: int | None) -> list[float]:
    """The plain fp32 recipe's losses on the same seeded batches (cached per workload, batch)."""
    if (name, batch) not in _BASELINES:
        torch._dynamo.reset()
        _BASELINES[name, batch] = train(load_workload(name, "tiny"), Recipe(batch=batch),
                                        steps=2, warmup=0).losses
    return _BASELINES[name, batch]


@pytest.mark.parametrize("workload", sorted(REGISTRY))
@pytest.mark.parametrize("tech", registry(), ids=lambda t: t.name)
def test_every_technique_on_every_tiny_workload(workload, tech):
    """Generated from the technique registry: each card's example applied to each tiny workload
    says what it did (its ``applied`` entry) or why it did nothing (a warning naming it), and
    keeps the loss: within fp32 rounding where the card says it does not change the numerics,
    within its precision's tolerance where it does."""
    wl = load_workload(workload, "tiny")
    recipe = _smoke_recipe(tech, wl)
    if unmet := unmet_requirements(recipe, "cpu"):
        pytest.skip(f"{tech.name} on a CPU: {'; '.join(unmet)}")
    torch._dynamo.reset()
    res = train(wl, recipe, steps=2, warmup=0)
    said = tech.name in res.applied or any(w.startswith(f"{tech.name}:") for w in res.warnings)
    assert said, f"{tech.name} neither applied nor warned: {res.applied}, {res.warnings}"
    for idle, why in res.no_effect.items():  # no effect (test_no_effect.py): said, with a reason
        assert why and any(w.startswith(f"{idle}:") for w in res.warnings), (idle, res.warnings)
    assert res.step_time_s > 0 and res.model_flops and res.model_flops > 0
    if tech.name == "init" or recipe.optimizer != "adamw":
        return  # other initial weights (host RNG) or another optimizer: other losses by design
    precision = "fp32" if not tech.changes_numerics or recipe.precision == "fp32" \
        else recipe.precision
    if tech.changes_numerics and precision == "fp32":
        precision = "tf32"  # fp32 maths in another summation order (fused kernels)
    verdict = compare(res.losses, _baseline(workload, recipe.batch), precision)
    assert verdict["passed"], f"{tech.name} on {workload}: {verdict}"


@pytest.mark.parametrize("workload", sorted(REGISTRY))
def test_the_graphed_step_body_makes_no_host_tensors_or_syncs(workload):
    """What a CUDA graph capture forbids, seen on the CPU: a tensor built from host data (a
    host-to-device copy on CUDA), ``.item()``-style syncs, data-dependent shapes."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from fasttrain.run.data import to_device

    class Forbidden(TorchDispatchMode):
        ops = {"lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "nonzero",
               "masked_select", "is_nonzero", "equal"}

        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in self.ops:
                self.seen[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    wl = load_workload(workload, "tiny")
    state, data, _ = prepare(wl, Recipe(precision="bf16-mixed", ema="none"), torch.device("cpu"))
    batch = to_device(wl.collate([data[i] for i in range(state.micro_batch)]),
                      torch.device("cpu"), False)
    mode = Forbidden()
    with mode, state.step_context():
        loss = wl.loss(state.model, batch)
    with mode:
        loss.backward()
    assert not mode.seen, dict(mode.seen)


def test_pad_collate_pads_to_the_longest_or_a_multiple():
    from fasttrain.workloads.data import pad_collate

    items = [{"ids": torch.arange(1, 4), "y": torch.tensor(1)},
             {"ids": torch.arange(1, 6), "y": torch.tensor(2)}]
    b = pad_collate(items, {"ids": -100})
    assert b["ids"].tolist() == [[1, 2, 3, -100, -100], [1, 2, 3, 4, 5]] and b["y"].tolist() == [1, 2]
    assert pad_collate(items, {"ids": 0}, multiple=4)["ids"].shape == (2, 8)


def test_padding_keeps_the_loss_and_leaves_one_compiled_shape():
    """Variable-length llama batches: padded to the longest item of each batch every batch is a
    new shape (a compiled graph each, until dynamo gives up); padded to a multiple of the window,
    one graph. Padded
    positions are ignored labels after every real token: the losses do not change."""
    wl = load_workload("llama", "tiny", varlen=True)
    lengths = {wl.dataset().length(i) for i in range(16)}
    assert len(lengths) > 4 and wl.pad_fields
    runs = {}
    for multiple in (0, wl.cfg.seq):
        torch._dynamo.reset()
        recipe = Recipe(pad_multiple=multiple, compile="model", compile_backend="aot_eager")
        runs[multiple] = train(wl, recipe, steps=9, warmup=1, device="cpu")
    loose, padded = runs[0], runs[wl.cfg.seq]
    assert loose.compile["unique_graphs"] > 1 and padded.compile["unique_graphs"] == 1
    # ten batches, more lengths than dynamo's limit of 8: compile gives up, and says so
    assert loose.compile["recompile_limit_hits"] == 1
    assert any("recompile limit was hit" in w for w in loose.warnings)
    assert not any("recompile limit" in w for w in padded.warnings)
    assert padded.losses == pytest.approx(loose.losses, rel=1e-5)
    assert "padded to a multiple of 64" in padded.applied["padding"]


def test_padding_on_fixed_length_batches_says_it_does_nothing():
    res = train(load_workload("vit", "tiny"), Recipe(pad_multiple=8), steps=1, warmup=0)
    assert any("pad_multiple ignored" in w for w in res.warnings)


def test_fused_kernels_keep_the_llama_losses_and_say_what_they_fused():
    wl = load_workload("llama", "tiny")
    plain = train(wl, Recipe(), steps=2, warmup=0, device="cpu")
    fused = train(wl, Recipe(kernels="fused"), steps=2, warmup=0, device="cpu")
    assert fused.losses == pytest.approx(plain.losses, rel=1e-5)
    for what in ("linear + cross-entropy, the logits' gradient written by the loss's kernel",
                 "SiLU(gate) · up", "RoPE of q and k",
                 "RMSNorm (with the residual add before it) in Triton ×5"):  # 2 a block + final
        assert what in fused.applied["kernels"]
    only = train(wl, Recipe(kernels="rope,patch"), steps=1, warmup=0, device="cpu")
    assert only.applied["kernels"] == "RoPE of q and k in one Triton kernel ×2"
    assert "kernels: llama has no patch layer" in only.warnings


def test_group_norm_kernels_keep_the_sd_losses_and_say_what_they_fused():
    wl = load_workload("sd", "tiny")
    base = Recipe(channels_last=True, batch=2)
    plain = train(wl, base, steps=2, warmup=0, device="cpu")
    fused = train(wl, base.replace(kernels="groupnorm,gelu,layernorm"), steps=2, warmup=0,
                  device="cpu")
    assert fused.losses == pytest.approx(plain.losses, rel=1e-5)
    assert "LayerNorm (with the residual add before it) in Triton ×" in fused.applied["kernels"]
    assert "GEGLU (bias, h · gelu(gate)) in one Triton kernel each way ×" in fused.applied["kernels"]
    assert "GroupNorm + SiLU in Triton (two passes each way) ×" in fused.applied["kernels"]
    assert "GroupNorm in Triton (two passes each way) ×" in fused.applied["kernels"]
    # ResNet blocks hand conv1's bias (and the time embedding, in the UNet) to norm2's kernels
    assert ("GroupNorm + SiLU in Triton (two passes each way), the convolution's bias and time "
            "embedding added in its kernels ×") in fused.applied["kernels"]
    assert ("GroupNorm + SiLU in Triton (two passes each way), the convolution's bias added in "
            "its kernels ×") in fused.applied["kernels"]
    # the VAE's RGB input and the UNet's 4 latent channels as GEMMs (channels_last)
    assert "3 → 32 channels, 3 × 3 as a gather + GEMM ×1" in fused.applied["channels_last"]
    assert "4 → 32 channels, 3 × 3 as a gather + GEMM ×1" in fused.applied["channels_last"]
    assert not fused.warnings


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_layer_norm_and_map_window_kernels_keep_the_swin_losses(precision):
    # kernels=window now attends on the unpartitioned map (shift and partition by address);
    # layernorm fuses each block's norms and the residual add before norm2. Under bf16
    # autocast the residual stream stays fp32 as on the plain path, the norms feed bf16.
    wl = load_workload("swin", "tiny")
    base = Recipe(batch=2, precision=precision)
    plain = train(wl, base, steps=2, warmup=0, device="cpu")
    fused = train(wl, base.replace(kernels="window,layernorm"), steps=2, warmup=0, device="cpu")
    assert fused.losses == pytest.approx(plain.losses, rel=1e-5 if precision == "fp32" else 2e-2)
    assert "LayerNorm (with the residual add before it) in Triton ×8" in fused.applied["kernels"]
    assert "shift and partition in one Triton kernel ×4" in fused.applied["kernels"]
    assert not fused.warnings


def test_padding_never_goes_past_the_models_length():
    from fasttrain.workloads.data import pad_collate

    items = [{"ids": torch.arange(60)}, {"ids": torch.arange(10)}]
    assert pad_collate(items, {"ids": 0}, multiple=48, max_len=64)["ids"].shape == (2, 64)
    assert pad_collate(items, {"ids": 0}, multiple=48)["ids"].shape == (2, 96)


def test_cuda_graphs_refuse_batches_whose_shapes_vary_and_take_fixed_length_padding():
    """Padded to their longest item, varlen batches change shape: refused with the way out.
    Padded to the model's length they keep one shape and are captured (their item counts vary,
    which the graph follows as a static input)."""
    from types import SimpleNamespace

    from fasttrain.techniques import cuda_graphs

    wl = load_workload("llama", "tiny", varlen=True)
    state = SimpleNamespace(cuda=True, workload=wl, recipe=Recipe(), autocast_cache=True)
    with pytest.raises(FasttrainError, match=f"shapes vary.*set pad_multiple={wl.max_length}"):
        cuda_graphs.apply(state)
    state.recipe = Recipe(pad_multiple=wl.max_length)
    assert "captured" in cuda_graphs.apply(state)


def test_compile_cache_is_saved_after_a_run_and_loaded_by_the_next(tmp_path, monkeypatch):
    """compile_cache: the first run compiles and saves torch.compile's artifacts; a second run
    of the same recipe loads them before compiling (Inductor's CPU backend, a tiny model)."""
    import sys

    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    sys.modules.pop("examples.my_workload", None)
    wl = load_workload("examples.my_workload:make_workload")
    recipe = Recipe(compile="model", compile_cache=True)
    first = train(wl, recipe, steps=1, warmup=1, device="cpu")
    assert "compile cache: none yet at" in first.applied["compile"]
    files = list((tmp_path / "compile").glob("my-classifier-*.bin"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    assert f"saved to {files[0]}" in first.applied["compile"]
    second = train(wl, recipe, steps=1, warmup=1, device="cpu")
    assert f"entries loaded from {files[0]}" in second.applied["compile"]
    assert second.losses == pytest.approx(first.losses)
    # another recipe is another file
    other = train(wl, recipe.replace(batch=16), steps=1, warmup=1, device="cpu")
    assert "none yet" in other.applied["compile"]
    assert len(list((tmp_path / "compile").glob("*.bin"))) == 2


def test_bf16_mixed_master_weights_refuse_several_ranks_and_a_missing_kernel(monkeypatch):
    """DDP would all-reduce the bf16 gradients, and only the one-launch AdamW keeps the masters:
    both are one-line errors before any weight is cast."""
    from fasttrain.run.loop import prepare
    from fasttrain.techniques import optimizer

    recipe = Recipe(precision="bf16-mixed", optimizer_impl="triton", master_weights=True)
    state, _, _ = prepare(load_workload("vit", "tiny"), recipe.replace(master_weights=False),
                          torch.device("cpu"))
    state.recipe, state.world = recipe, 2
    with pytest.raises(FasttrainError, match="runs on one process .* for 2 ranks"):
        optimizer.apply(state)
    state.world = 1
    monkeypatch.setattr(optimizer, "_flat_unfit", lambda s, p: "triton is not installed")
    with pytest.raises(FasttrainError, match="cannot run here: triton is not installed"):
        optimizer.apply(state)
    assert all(p.dtype == torch.float32 for p in state.model.parameters())


def test_a_layer_with_use_fused_but_not_the_protocol_is_named_and_left_alone():
    """A layer written to the old duck-typed contract (only ``use_fused``) is not switched
    silently: the kernels switch names it and says how to fix it."""
    from fasttrain import SimpleWorkload
    from fasttrain.layers.fused import FusedPath

    class OldStyle(torch.nn.Linear):
        fused_kind = "gelu"

        def use_fused(self, on):
            raise AssertionError("must not be called")

    class NewStyle(FusedPath, torch.nn.Linear):
        fused_kind = "gelu"

        def use_fused(self, on):
            self.fused = on
            return ["switched"]

    def build():
        return torch.nn.Sequential(OldStyle(4, 4), NewStyle(4, 2))

    wl = SimpleWorkload(name="mine", build=build,
                        data=lambda: [{"x": torch.randn(4), "y": torch.tensor(i % 2)}
                                      for i in range(8)],
                        loss_fn=lambda m, b: torch.nn.functional.cross_entropy(
                            m(b["x"]), b["y"], reduction="sum"), default_batch=4)
    res = train(wl, Recipe(kernels="gelu"), steps=1, warmup=0)
    assert res.applied["kernels"] == "switched ×1"
    assert any(w.startswith("kernels: OldStyle offer use_fused but not the rest")
               for w in res.warnings), res.warnings


def test_compile_stats_say_why_the_graph_broke():
    """A graph break inside a compiled function: the run's compile stats count it and keep its
    reason (a break in a repeated block costs every block; its reason says where)."""
    from fasttrain.techniques.compile import graph_stats

    def broken(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    torch._dynamo.reset()
    before = graph_stats()
    fn = torch.compile(broken, backend="eager")
    fn(torch.ones(3))
    stats = graph_stats(before)
    assert stats["graph_breaks"] >= 1
    assert stats["break_reasons"] and all(n >= 1 for n in stats["break_reasons"].values())
    assert any("graph_break" in r.lower() or "break" in r.lower() for r in stats["break_reasons"])
    fn(torch.ones(3))  # the same graphs again: no new break
    assert graph_stats(graph_stats())["break_reasons"] == {}
