"""The one-launch AdamW with its two moments in bf16 (``state_dtype=torch.bfloat16``, the
recipe's ``optimizer_state=bf16``), in Triton's interpreter on the CPU: the stochastic rounding
itself (unbiased, always onto a neighbour, infinities and NaNs kept), the moments' decay that
round-to-nearest would lose, the training against PyTorch's fp32 AdamW, state dicts in both
directions, bad input and the recipe."""
import pytest
import torch

pytest.importorskip("triton")

from tests.interpreted import interpret, kernels_interpreted  # noqa: E402,F401

with kernels_interpreted():
    import triton
    import triton.language as tl

    from fasttrain.kernels._triton import mix32, to_bf16_stochastic
    from fasttrain.optim.adamw import FlatAdamW

    @triton.jit
    def _round_kernel(x_ptr, out_ptr, n, seed, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        noise = mix32(offs.to(tl.uint32) * 0x9E3779B1 + seed.to(tl.uint32)) & 0xFFFF
        tl.store(out_ptr + offs, to_bf16_stochastic(x, noise), mask=offs < n)

from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.recipe import Recipe  # noqa: E402


def _round(x: torch.Tensor, seed: int) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), seed, BLOCK=1024)
    return out


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    # values a quarter and three quarters of the way between bf16 neighbours, both signs
    lo = torch.tensor([1.0, -3.0, 1e-3, 2.0 ** -130], dtype=torch.bfloat16).float()
    ulp = torch.tensor([2.0 ** -7, -2.0 ** -6, 2.0 ** -17, 2.0 ** -133])  # (a subnormal)
    for frac in (0.25, 0.75):
        x = (lo + frac * ulp).repeat_interleave(4096)
        draws = torch.stack([_round(x, seed).float() for seed in range(8)])
        down, up = lo.repeat_interleave(4096), (lo + ulp).repeat_interleave(4096)
        assert bool(((draws == down) | (draws == up)).all())  # always a neighbour
        share_up = (draws == up).float().view(8, 4, 4096).mean(dim=(0, 2))
        torch.testing.assert_close(share_up, torch.full((4,), frac), atol=0.01, rtol=0)
    exact = torch.tensor([0.0, -0.0, 1.5, -2.0, float("inf"), float("-inf")])
    assert torch.equal(_round(exact, 3).float(), exact)  # representable values stay
    assert bool(_round(torch.tensor([float("nan")]), 3).isnan().all())
    # a new seed draws new noise: the rounding of one element is not fixed across steps
    x = torch.full((4096,), 1.0 + 2.0 ** -8)
    assert not torch.equal(_round(x, 1), _round(x, 2))


def test_the_second_moment_decays_in_bf16_where_round_to_nearest_would_freeze_it():
    # after a first step, gradients of zero: v must shrink by beta2 every step. 0.999·v
    # rounded to nearest in bf16 is v again, so without stochastic rounding it never moves
    w = torch.zeros(8192, requires_grad=True)
    opt = FlatAdamW([w], lr=0.0, betas=(0.9, 0.999), weight_decay=0.0,
                    state_dtype=torch.bfloat16)
    w.grad = torch.ones(8192)
    opt.step()
    v0 = opt.state[w]["exp_avg_sq"].float().mean().item()
    w.grad = torch.zeros(8192)
    for _ in range(100):
        opt.step()
    v = opt.state[w]["exp_avg_sq"]
    assert v.dtype == torch.bfloat16 and opt.state[w]["exp_avg"].dtype == torch.bfloat16
    torch.testing.assert_close(v.float().mean().item(), v0 * 0.999 ** 100, rtol=2e-3, atol=0)
    to_nearest = torch.tensor(v0).bfloat16()
    for _ in range(100):
        to_nearest = (0.999 * to_nearest.float()).bfloat16()
    assert to_nearest.item() == torch.tensor(v0).bfloat16().item()  # what SR avoids


def _model_pair():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
    b = torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
    b.load_state_dict(a.state_dict())
    return a, b


def test_training_with_bf16_moments_follows_fp32_adamw():
    ours, ref = _model_pair()
    opt = FlatAdamW(list(ours.parameters()), lr=3e-3, max_grad_norm=1.0,
                    state_dtype=torch.bfloat16)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 33, generator=g), torch.randint(0, 7, (64,), generator=g)
    losses = []
    for _ in range(30):  # one batch, learnt by heart
        pair = []
        for model, o in ((ours, opt), (ref, torch_opt)):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if o is torch_opt:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            o.step()
            o.zero_grad()
            pair.append(loss.item())
        losses.append(pair)
    first, last = losses[0], losses[-1]
    assert last[0] < 0.8 * first[0]  # it trains
    assert abs(last[0] - last[1]) < 0.01 * last[1]  # as fp32 AdamW does
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert a.dtype == torch.float32  # the weights stay fp32
        # 30 steps of lr 3e-3: the weights agree to a small part of how far they moved
        assert (a - b).abs().max() < 0.05 * 30 * 3e-3
        for key in ("exp_avg", "exp_avg_sq"):
            mine, theirs = opt.state[a][key].float(), torch_opt.state[b][key]
            # (the trajectories part a little: other weights, other gradients)
            torch.testing.assert_close(mine, theirs, rtol=0.03, atol=0.01 * theirs.abs().max())


def test_bf16_moments_with_bf16_weights_and_fp32_masters():
    w16 = torch.randn(300).bfloat16().requires_grad_()
    master = w16.detach().float() + 1e-3  # the fp32 master differs from the rounded weight
    opt = FlatAdamW([w16], lr=1e-2, masters=[master], state_dtype=torch.bfloat16)
    ref = master.clone().requires_grad_()
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
    for step in range(5):
        g = torch.randn(300, generator=torch.Generator().manual_seed(step)).bfloat16()
        w16.grad, ref.grad = g, g.float()
        opt.step()
        torch_opt.step()
    assert opt.masters[0].dtype == torch.float32
    torch.testing.assert_close(opt.masters[0], ref.detach(), rtol=0, atol=5 * 0.02 * 1e-2)
    assert torch.equal(w16.detach(), opt.masters[0].bfloat16())  # the weight: its master


def test_state_dicts_load_both_ways():
    ours, ref = _model_pair()
    opt = FlatAdamW(list(ours.parameters()), lr=1e-2, state_dtype=torch.bfloat16)
    x = torch.randn(8, 33)
    for _ in range(3):
        ours(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    assert saved["state"][0]["exp_avg"].dtype == torch.bfloat16
    # bf16 moments into a bf16 optimizer: the same next step, bit for bit (the noise is a
    # function of the element and the step, not of a generator's state)
    twin, _ = _model_pair()
    twin.load_state_dict(ours.state_dict())
    twin_opt = FlatAdamW(list(twin.parameters()), lr=1e-2, state_dtype=torch.bfloat16)
    twin_opt.load_state_dict(saved)
    for model, o in ((ours, opt), (twin, twin_opt)):
        model(x).square().mean().backward()
        o.step()
    for a, b in zip(ours.parameters(), twin.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], twin_opt.state[b]["exp_avg_sq"])
    # ... into fp32 moments: exactly; and fp32 moments into bf16: rounded to nearest
    wide_opt = FlatAdamW(list(ref.parameters()), lr=1e-2)
    wide_opt.load_state_dict(opt.state_dict())
    first = next(iter(ref.parameters()))
    assert wide_opt.state[first]["exp_avg"].dtype == torch.float32
    assert torch.equal(wide_opt.state[first]["exp_avg"],
                       opt.state[next(iter(ours.parameters()))]["exp_avg"].float())
    narrow_opt = FlatAdamW(list(twin.parameters()), lr=1e-2, state_dtype=torch.bfloat16)
    narrow_opt.load_state_dict(wide_opt.state_dict())
    assert torch.equal(narrow_opt.state[next(iter(twin.parameters()))]["exp_avg"],
                       wide_opt.state[first]["exp_avg"].bfloat16())


def test_bad_input_is_one_line():
    with pytest.raises(FasttrainError, match="moments in fp32 or bf16, not torch.float16"):
        FlatAdamW([torch.zeros(3, requires_grad=True)], state_dtype=torch.float16)
    with pytest.raises(FasttrainError, match="optimizer_state=bf16 keeps AdamW's moments in "
                                             "the one-launch AdamW; set optimizer_impl=triton"):
        Recipe(optimizer_state="bf16", optimizer_impl="fused")
    with pytest.raises(FasttrainError, match="optimizer_state"):
        Recipe(optimizer_state="fp8", optimizer_impl="triton")


def test_the_recipe_keeps_its_moments_in_bf16_and_says_so():
    from fasttrain.run.loop import train
    from fasttrain.workloads import load_workload

    wl = load_workload("vit", "tiny")
    seen = {state: train(wl, Recipe(optimizer_impl="triton", lr=1e-3, optimizer_state=state),
                         steps=3, warmup=0, device="cpu")
            for state in ("fp32", "bf16")}
    assert "both moments in bf16, rounded stochastically" in seen["bf16"].applied["optimizer"]
    assert "moments in bf16" not in seen["fp32"].applied["optimizer"]
    a, b = seen["fp32"].losses, seen["bf16"].losses
    assert a[0] == b[0]  # the same first step: the moments only act from the update on
    assert a != b and max(abs(x - y) for x, y in zip(a, b)) < 0.02 * abs(a[0])
    assert not seen["bf16"].warnings


def test_where_pytorch_s_adamw_stands_in_the_moments_stay_fp32_and_it_is_said():
    from fasttrain.run.loop import train
    from fasttrain.workloads import load_workload

    res = train(load_workload("vit", "tiny"), Recipe(optimizer_impl="triton",
                                                     precision="bf16-true",
                                                     optimizer_state="bf16"),
                steps=1, warmup=0, device="cpu")
    assert "fused: triton could not run" in res.applied["optimizer"]
    assert any("with fp32 moments: optimizer_state=bf16 has no effect" in w for w in res.warnings)
    assert res.no_effect["optimizer_state"] == "PyTorch's AdamW keeps fp32 moments"
