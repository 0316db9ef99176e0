"""The one-launch AdamW compiled on CUDA (marker ``gpu``; skipped without a GPU). A sibling of
test_adamw.py, whose kernel runs in Triton's interpreter and which is skipped on a GPU
(tests/interpreted.py)."""
import pytest
import torch

from fasttrain.recipe import Recipe
from fasttrain.run.loop import train
from fasttrain.workloads import load_workload


def _optimizer_steps(params, opt, grads, graphed: bool, after=None) -> None:
    """Step ``opt`` once per entry of ``grads`` (a list of gradients a step), each step's
    gradients copied into static tensors and handed to ``params`` as fresh tensors, as a graphed
    training step's backward does. ``graphed``: the first step eagerly on a side stream (the
    kernel compiles there), the rest as replays of one captured step. ``after()`` runs after
    every step (a scheduler's)."""
    src = [torch.zeros_like(p) for p in params]  # a graph's input: this step's gradients

    def step():
        for p, g in zip(params, src):  # "backward": a fresh gradient tensor every step
            p.grad = g * 1.0
        opt.step()

    graph = None
    for k, gs in enumerate(grads):
        torch._foreach_copy_(src, gs)
        if not graphed:
            step()
        elif k == 0:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            if graph is None:
                for p in params:
                    p.grad = None
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
            graph.replay()
        if after is not None:
            after()
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_one_launch_adamw_on_cuda_matches_torch_eager_and_in_a_cuda_graph():
    """FlatAdamW (clip + AdamW + EMA in one launch) against PyTorch's fused AdamW, clip and
    foreach EMA on CUDA; then the same steps captured in one CUDA graph and replayed, with fresh
    gradients written by the graph each time, as the training loop's graphed step does."""
    from fasttrain.optim.adamw import FlatAdamW

    torch.manual_seed(0)
    shapes = [(320, 320, 3, 3), (1280,), (77, 768), (5,), (4099, 33)]
    init = [torch.randn(s, device="cuda") for s in shapes]
    init[0] = init[0].contiguous(memory_format=torch.channels_last)
    grads = [[torch.randn(s, device="cuda") for s in shapes] for _ in range(6)]

    def run(graphed: bool):
        ours = [w.clone().requires_grad_() for w in init]
        opt = FlatAdamW(ours, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
        shadow = opt.attach_ema(0.99)
        _optimizer_steps(ours, opt, grads, graphed)
        return ours, shadow, opt

    ref = [w.clone().requires_grad_() for w in init]
    torch_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, fused=True)
    ema = [w.clone() for w in init]
    for gs in grads:
        for w, g in zip(ref, gs):  # in the weight's memory order, as autograd makes them (fused
            w.grad = torch.empty_like(w).copy_(g)  # AdamW misreads a channels-last weight's
        torch.nn.utils.clip_grad_norm_(ref, 1.0)  # contiguous gradient)
        torch_opt.step()
        torch._foreach_lerp_(ema, [w.detach() for w in ref], 0.01)
    for graphed in (False, True):
        ours, shadow, opt = run(graphed)
        torch.cuda.synchronize()
        for a, b, s, e in zip(ours, ref, shadow, ema):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s, e, rtol=1e-5, atol=1e-6)
        assert opt._steps.tolist() == [6.0] * len(shapes)


@pytest.mark.gpu
def test_one_launch_optimizer_in_the_graphed_training_loop_keeps_the_losses():
    wl = load_workload("sd", "tiny")
    base = Recipe(precision="bf16-mixed", optimizer_impl="fused", ema="foreach",
                  compile="regional", cuda_graphs=True, lr=1e-3)
    plain = train(wl, base, steps=6, warmup=4, device="cuda")
    ours = train(wl, base.replace(optimizer_impl="triton"), steps=6, warmup=4, device="cuda")
    assert "one Triton launch" in ours.applied["optimizer"] and not ours.warnings
    assert "folded into the optimizer's Triton kernel" in ours.applied["ema"]
    # bf16 activations: an update that differs in the last fp32 bit can round a few
    # activations the other way, so the bf16 parity tolerance
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(plain.losses),
                               rtol=2e-2, atol=0)


@pytest.mark.gpu
def test_one_launch_adamw_steps_bf16_weights_through_fp32_masters_on_cuda():
    """bf16 weights with fp32 masters (master_weights under bf16-mixed): the masters follow the
    fp32 FlatAdamW given the same (bf16) gradients, the weights are exactly the masters rounded
    to nearest even, eager and in a CUDA graph, next to fp32 weights in the same launch. (The
    clip norm of bf16 gradients, accumulated in fp32, may differ from that of their fp32 copies
    in the last bit: PyTorch's multi-tensor norm sums them in another order.)"""
    from fasttrain.optim.adamw import FlatAdamW

    torch.manual_seed(0)
    shapes = [(320, 320, 3, 3), (1280,), (77, 768), (5,), (4099, 33)]
    init = [torch.randn(s, device="cuda") for s in shapes]
    grads = [[torch.randn(s, device="cuda").bfloat16() for s in shapes] for _ in range(4)]
    half = [True, True, False, True, True]  # one fp32 weight (a norm's) among them
    ref = [w.clone().requires_grad_() for w in init]
    ref_opt = FlatAdamW(ref, lr=1e-3, max_grad_norm=1.0)
    ours = [(w.bfloat16() if h else w.clone()).requires_grad_() for w, h in zip(init, half)]
    opt = FlatAdamW(ours, lr=1e-3, max_grad_norm=1.0,
                    masters=[w.clone() if h else None for w, h in zip(init, half)])
    src = [torch.zeros_like(w) for w in ours]

    def step():
        for w, g in zip(ours, src):
            w.grad = g * 1
        opt.step()

    for k, gs in enumerate(grads):
        for w, g in zip(ref, gs):
            w.grad = g.float()
        ref_opt.step()
        torch._foreach_copy_(src, [g.to(w.dtype) for g, w in zip(gs, ours)])
        if k < 2:
            step()
        elif k == 2:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph.replay()
        else:
            graph.replay()
    torch.cuda.synchronize()
    for w, r, m, h in zip(ours, ref, opt.masters, half):
        torch.testing.assert_close(m if h else w, r.detach(), rtol=1e-6, atol=1e-6)
        if h:
            assert torch.equal(w.detach(), m.bfloat16())


@pytest.mark.gpu
def test_bf16_master_weights_in_the_graphed_training_loop_keep_the_losses():
    """master_weights under bf16-mixed, compiled and in CUDA graphs: the same losses as
    autocast over fp32 weights (within the bf16 tolerance: compile may fuse casts
    differently), and the linear weights are bf16 while the norms stay fp32."""
    for workload in ("vit", "swin"):
        wl = load_workload(workload, "tiny")
        base = Recipe(precision="bf16-mixed", optimizer_impl="triton", compile="model",
                      cuda_graphs=True, lr=1e-3)
        plain = train(wl, base, steps=6, warmup=2, device="cuda")
        ours = train(wl, base.replace(master_weights=True), steps=6, warmup=2, device="cuda")
        assert "stored in bf16 with fp32 masters" in ours.applied["optimizer"]
        assert not ours.warnings
        torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(plain.losses),
                                   rtol=2e-2, atol=0)



@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "fused"])
def test_a_cosine_schedule_reaches_the_replays_of_a_captured_step(impl):
    """The optimizer's rate on the device, written in place by the scheduler between replays:
    a captured step under a cosine schedule ends where the same steps run eagerly end, for the
    one-launch AdamW and for PyTorch's capturable fused AdamW as the recipe builds them, and
    not where a constant rate would have taken it."""
    from fasttrain.optim.adamw import FlatAdamW
    from fasttrain.techniques.optimizer import LrFactor, build

    torch.manual_seed(0)
    shapes = [(256, 256), (1280,), (77, 33)]
    init = [torch.randn(s, device="cuda") for s in shapes]
    grads = [[torch.randn(s, device="cuda") for s in shapes] for _ in range(8)]
    recipe = Recipe(optimizer_impl=impl, schedule="cosine", cuda_graphs=True,
                    precision="bf16-mixed")

    def run(graphed: bool, schedule: bool = True):
        ws = [w.clone().requires_grad_() for w in init]
        opt = (FlatAdamW(ws, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0) if impl == "triton"
               else build(ws, recipe, 1e-2, capturable=True))
        sched = (torch.optim.lr_scheduler.LambdaLR(opt, LrFactor(len(grads))) if schedule
                 else None)
        _optimizer_steps(ws, opt, grads, graphed, sched.step if sched is not None else None)
        return ws

    eager, graphed, constant = run(False), run(True), run(True, schedule=False)
    for a, b, c in zip(graphed, eager, constant):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert (a - c).abs().max() > 1e-3  # the schedule changed the weights


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "fused"])
def test_the_graphed_training_loop_follows_a_cosine_schedule(impl):
    """lr_warmup and schedule=cosine with cuda_graphs: every call of the graphed step (its eager
    warm-up steps and its replays) steps the schedule, so the rates and the losses are the eager
    run's."""
    wl = load_workload("vit", "tiny")
    base = Recipe(precision="bf16-mixed", optimizer_impl=impl, schedule="cosine", lr=1e-2,
                  lr_warmup=3)
    eager = train(wl, base, steps=6, warmup=4, device="cuda")
    graphed = train(wl, base.replace(cuda_graphs=True), steps=6, warmup=4, device="cuda")
    assert not graphed.warnings, graphed.warnings
    assert graphed.lrs == pytest.approx(eager.lrs) and graphed.lrs[-1] < max(graphed.lrs)
    torch.testing.assert_close(torch.tensor(graphed.losses), torch.tensor(eager.losses),
                               rtol=2e-2, atol=0)


@pytest.mark.gpu
def test_bf16_moments_on_cuda_are_stochastically_rounded_and_replay_as_they_ran_eagerly():
    """Compiled, the bf16 moments' stochastic rounding keeps a second moment decaying that
    round-to-nearest would freeze, follows fp32 AdamW, and gives the same bits in a CUDA graph
    as eagerly (the noise is a function of the element and the step)."""
    from fasttrain.optim.adamw import FlatAdamW

    w = torch.zeros(1 << 20, device="cuda", requires_grad=True)
    opt = FlatAdamW([w], lr=0.0, weight_decay=0.0, state_dtype=torch.bfloat16)
    w.grad = torch.ones_like(w)
    opt.step()
    v0 = opt.state[w]["exp_avg_sq"].float().mean().item()
    w.grad = torch.zeros_like(w)
    for _ in range(100):
        opt.step()
    torch.testing.assert_close(opt.state[w]["exp_avg_sq"].float().mean().item(),
                               v0 * 0.999 ** 100, rtol=1e-3, atol=0)

    torch.manual_seed(0)
    init = [torch.randn(s, device="cuda") for s in ((4099, 33), (1280,), (77, 768))]
    grads = [[torch.randn_like(x) for x in init] for _ in range(5)]

    def run(graphed: bool):
        ours = [x.clone().requires_grad_() for x in init]
        o = FlatAdamW(ours, lr=1e-3, max_grad_norm=1.0, state_dtype=torch.bfloat16)
        _optimizer_steps(ours, o, grads, graphed)
        return ours

    eager, replayed = run(False), run(True)
    ref = [x.clone().requires_grad_() for x in init]
    torch_opt = torch.optim.AdamW(ref, lr=1e-3, fused=True)
    for gs in grads:
        for p, g in zip(ref, gs):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        torch_opt.step()
    torch.cuda.synchronize()
    for a, b, c in zip(eager, replayed, ref):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=0, atol=5 * 1e-3 * 0.02)
