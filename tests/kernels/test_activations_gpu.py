"""The activation kernels (bias + GELU, SwiGLU, GEGLU; with RoPE) compiled on CUDA (marker
``gpu``; skipped without a GPU). A sibling of test_activations.py, whose kernels run in
Triton's interpreter and which is skipped on a GPU (tests/interpreted.py)."""
import pytest
import torch

from tests.gpu_helpers import compiled_and_reference


@pytest.mark.gpu
def test_activation_and_rope_kernels_compiled_on_cuda_match_the_reference():
    from fasttrain.kernels import activations as act
    from fasttrain.kernels.rope import rope, rope_reference

    torch.manual_seed(0)
    x = torch.randn(300, 1000, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1000, device="cuda")
    for approximate in ("none", "tanh"):
        compiled_and_reference(lambda x, b: act.bias_gelu(x, b, approximate),
                                lambda x, b: act.bias_gelu_reference(x, b, approximate), [x, b],
                                lambda y: (y.float() * 1.5).square().sum())
    g, u = torch.randn(2, 3, 999, device="cuda", dtype=torch.bfloat16).unbind(0)
    compiled_and_reference(act.swiglu, act.swiglu_reference, [g, u],
                            lambda y: (y.float() * 1.5).square().sum())
    q = torch.randn(2, 100, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 100, 2, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    ang = torch.rand(100, 32, device="cuda") * 6
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    compiled_and_reference(
        lambda q, k: rope(q, k, cos, sin), lambda q, k: rope_reference(q, k, cos, sin), [q, k],
        lambda qk: (qk[0].float().square() * 2).sum() + qk[1].float().sum())


@pytest.mark.gpu
def test_exact_gelu_kernels_on_cuda_are_within_a_few_ulp_of_erf():
    """Compiled for the GPU, fp32, z in [-9, 9], against PyTorch's GELU in float64."""
    from fasttrain.kernels import activations as act
    from tests.helpers import check_exact_gelu

    check_exact_gelu(act.bias_gelu, "cuda", 40001)


@pytest.mark.gpu
def test_pipelined_loops_over_many_tiles_per_program_match_the_reference():
    """The persistent loops with software-pipelined loads (the interpreter ignores num_stages,
    so only a GPU runs them), at shapes where each program walks many tiles: bias + GELU's
    backward (dx and the bias gradient), GEGLU's (dx and the bias gradient) and GroupNorm's
    reduction pass."""
    from fasttrain.kernels import activations as act
    from fasttrain.kernels import group_norm as gn

    torch.manual_seed(0)
    x = torch.randn(20_000, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, device="cuda")
    block_r, block_d = act._tile(512, act.LAUNCH["bwd_elements"], act.LAUNCH["bwd_block_d"])
    per = act._grid_persistent(x.device, 20_000, 512, block_r, block_d,
                               act.LAUNCH["programs_per_sm"])[2]
    assert act.LAUNCH["stages"] > 1 and per >= 4 * block_r  # several tiles a program
    compiled_and_reference(lambda x, b: act.bias_gelu(x, b), act.bias_gelu_reference, [x, b],
                            lambda y: (y.float() * 1.5).square().sum())
    from fasttrain.kernels import geglu as gg

    x = torch.randn(20_000, 2 * 640, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2 * 640, device="cuda")
    progs, _, per, block_r, _ = gg._geglu_bwd_grid(x.device, 20_000, 640)
    assert gg.GEGLU["stages"] > 1 and per >= 4 * block_r and progs > 1
    compiled_and_reference(gg.geglu, gg.geglu_reference, [x, b],
                            lambda y: (y.float() * 1.5).square().sum())
    shape = (2, 128, 256, 256)
    x = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 2 + 0.5).contiguous(
        memory_format=torch.channels_last)
    w, bias = torch.randn(128, device="cuda"), torch.randn(128, device="cuda")
    rows_per = gn._blocks(256 * 256, 128, 2, x.device)[3]
    assert gn.LAUNCH["sum_stages"] > 1 and rows_per >= 4 * gn.LAUNCH["sum_rows"]
    cot = torch.randn(shape, device="cuda")
    compiled_and_reference(lambda x, w, b: gn.group_norm(x, w, b, 32, 1e-5, True),
                            lambda x, w, b: gn.group_norm_reference(x, w, b, 32, 1e-5, True),
                            [x, w, bias], lambda y: (y.float() * cot).sum())

