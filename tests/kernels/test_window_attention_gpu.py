"""The window-attention kernels compiled on CUDA (marker ``gpu``; skipped without a GPU). A
sibling of test_window_attention.py, whose kernels run in Triton's interpreter and which is
skipped on a GPU (tests/interpreted.py)."""
import pytest
import torch

from fasttrain.recipe import Recipe
from tests.gpu_helpers import compiled_and_reference, kernels_keep_the_losses


@pytest.mark.gpu
def test_window_attention_compiled_on_cuda_matches_the_reference():
    from fasttrain.kernels.window_attention import window_attention, window_attention_reference
    from fasttrain.layers.windows import shift_mask

    torch.manual_seed(0)
    # 16 windows per image, 80 images: more windows than the persistent programs of both
    # kernels, so each walks several (the forward's next windows loaded while it computes)
    qkv = torch.randn(1280, 49, 3 * 128, device="cuda", dtype=torch.bfloat16)
    bias = 0.5 * torch.randn(4, 49, 49, device="cuda")
    mask = shift_mask(28, 7, 3).cuda()
    cot = torch.randn(1280, 49, 128, device="cuda")
    compiled_and_reference(lambda q, b: window_attention(q, b, mask, 4),
                            lambda q, b: window_attention_reference(q, b, mask, 4), [qkv, bias],
                            lambda out: (out.float() * cot).sum())


@pytest.mark.gpu
def test_map_window_attention_compiled_on_cuda_matches_the_reference():
    from fasttrain.kernels.window_attention import (map_window_attention,
                                                    map_window_attention_reference)
    from fasttrain.layers.windows import shift_mask

    torch.manual_seed(0)
    qkv = torch.randn(4, 28, 28, 3 * 128, device="cuda", dtype=torch.bfloat16)
    bias = 0.5 * torch.randn(4, 49, 49, device="cuda")
    mask = shift_mask(28, 7, 3).cuda()
    cot = torch.randn(4, 28, 28, 128, device="cuda")
    compiled_and_reference(lambda q, b: map_window_attention(q, b, mask, 4, 7, 3),
                            lambda q, b: map_window_attention_reference(q, b, mask, 4, 7, 3),
                            [qkv, bias], lambda out: (out.float() * cot).sum())


@pytest.mark.gpu
def test_swin_window_kernel_in_the_compiled_training_loop_keeps_the_losses():
    kernels_keep_the_losses("swin", Recipe(precision="bf16-mixed", optimizer_impl="fused",
                                            compile="model"),
                             ("window", "window,layernorm"), "window attention")

