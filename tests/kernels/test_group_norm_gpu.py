"""The GroupNorm kernels compiled on CUDA (marker ``gpu``; skipped without a GPU). A sibling of
test_group_norm.py, whose kernels run in Triton's interpreter and which is skipped on a GPU
(tests/interpreted.py)."""
import pytest
import torch

from fasttrain.recipe import Recipe
from tests.gpu_helpers import compiled_and_reference, kernels_keep_the_losses


@pytest.mark.gpu
def test_group_norm_kernel_compiled_on_cuda_matches_the_reference():
    """Channels-last bf16 at UNet and VAE widths (groups of 10, 4 and 40 channels), with and
    without SiLU, compiled by Inductor; an NCHW input; several programs per sample."""
    from fasttrain.kernels.group_norm import group_norm, group_norm_reference

    torch.manual_seed(0)
    for shape, silu in [((4, 320, 24, 24), True), ((2, 128, 96, 80), True),
                        ((4, 1280, 8, 8), False)]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
        x = x.contiguous(memory_format=torch.channels_last)
        w, b = torch.randn(shape[1], device="cuda"), torch.randn(shape[1], device="cuda")
        cot = torch.randn(shape, device="cuda")
        compiled_and_reference(lambda x, w, b: group_norm(x, w, b, 32, 1e-5, silu),
                                lambda x, w, b: group_norm_reference(x, w, b, 32, 1e-5, silu),
                                [x, w, b], lambda y: (y.float() * cot).sum())
    x = torch.randn(2, 64, 33, 17, device="cuda", dtype=torch.bfloat16)
    w, b = torch.ones(64, device="cuda"), torch.zeros(64, device="cuda")
    compiled_and_reference(lambda x, w, b: group_norm(x, w, b, 32, 1e-6, True),
                            lambda x, w, b: group_norm_reference(x, w, b, 32, 1e-6, True),
                            [x, w, b], lambda y: (y.float() * 1.5).square().sum())
    # more samples than a CUDA grid's second axis holds (65,535)
    x = torch.randn(70_000, 64, device="cuda")
    torch.testing.assert_close(group_norm(x, w, b, 32, 1e-6, True),
                               group_norm_reference(x, w, b, 32, 1e-6, True))


def _kernels_over(code: list[str], numel: int) -> list[str]:
    """The Triton kernels in Inductor's generated ``code`` whose elementwise loop covers
    ``numel`` elements."""
    import re

    return [k for k in re.split(r"@triton\.jit", "\n".join(code))
            if re.search(rf"xnumel = {numel}\b", k)]


@pytest.mark.gpu
def test_group_norm_of_a_bias_add_is_written_once_by_inductor():
    """GroupNorm of a convolution's output + bias (the VAE's and UNet's ResNet blocks): the
    sum is a value Inductor has not written yet, and the kernels take it three times (the
    reduction, the elementwise pass, the first position's values). Inductor must write it once;
    handed views of it, it wrote one copy per kernel argument (four stores in one kernel)."""
    from torch._inductor.utils import run_and_get_code

    from fasttrain.kernels.group_norm import group_norm, group_norm_reference

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(32, 64, 3, padding=1).cuda().to(torch.bfloat16)
    conv = conv.to(memory_format=torch.channels_last)
    w, b = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")

    def block(x):
        return group_norm(conv(x), w, b, 32, 1e-6, True)

    x = torch.randn(2, 32, 32, 32, device="cuda", dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        y, code = run_and_get_code(torch.compile(block, fullgraph=True), x)
        ref = group_norm_reference(conv(x), w, b, 32, 1e-6, True)
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)
    full = _kernels_over(code, y.numel())  # the convolution's output; x has half as many
    assert len(full) == 1, f"{len(full)} elementwise kernels over the convolution's output"
    assert full[0].count("tl.store(") == 1


@pytest.mark.gpu
def test_frozen_resnet_block_with_group_norm_kernels_writes_its_input_once():
    """A VAE ResNet block (frozen, bf16, channels-last) with the GroupNorm kernels, compiled,
    its input a sum Inductor has not written yet (a previous block's output): the sum is
    written once, and the block's output kernel reads it back (with conv2's output and bias)
    rather than recomputing it from its two terms; conv1's bias goes into norm2's kernels, so
    no kernel writes conv1 + bias. Two elementwise kernels over the block's size in all."""
    import re

    from torch._inductor.utils import run_and_get_code

    from fasttrain.layers.unet import ResnetBlock

    torch.manual_seed(0)
    blk = ResnetBlock(64, 64, None, 1e-6).cuda().to(torch.bfloat16).requires_grad_(False)
    blk = blk.to(memory_format=torch.channels_last)
    a, b = (torch.randn(2, 64, 32, 32, device="cuda", dtype=torch.bfloat16)
            .contiguous(memory_format=torch.channels_last) for _ in range(2))
    with torch.no_grad():
        ref = blk(a + b)
        for m in (blk.norm1, blk.norm2):
            m.use_fused(True)
        y, code = run_and_get_code(torch.compile(lambda s, t: blk(s + t), fullgraph=True), a, b)
    torch.testing.assert_close(y.float(), ref.float(), atol=3e-2, rtol=3e-2)
    full = _kernels_over(code, y.numel())
    heads = [re.search(r"def \w+\([^)]*\)", k).group(0) for k in full]
    assert len(full) == 2, f"elementwise kernels over the block's size: {heads}"
    assert all(k.count("tl.store(") == 1 for k in full), heads
    # inputs, counting a buffer Inductor writes over (conv2's output, in_out_ptr)
    inputs = sorted(len(set(re.findall(r"\bin_(?:out_)?ptr\d+\b", h))) for h in heads)
    assert inputs == [2, 3], f"{heads}: want the sum's two terms, then the output's sum, conv2 "\
        "and its bias"


@pytest.mark.gpu
def test_sd_group_norm_kernel_in_the_compiled_training_loop_keeps_the_losses():
    kernels_keep_the_losses("sd", Recipe(precision="bf16-mixed", optimizer_impl="fused",
                                          compile="regional", channels_last=True),
                             ("groupnorm", "groupnorm,gelu,layernorm"),
                             "GroupNorm + SiLU in Triton")

