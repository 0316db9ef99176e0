"""The sequence-attention kernels compiled on CUDA (marker ``gpu``; skipped without a GPU). A
sibling of test_seq_attention.py, whose kernels run in Triton's interpreter and which is
skipped on a GPU (tests/interpreted.py)."""
import pytest
import torch

from fasttrain.recipe import Recipe
from tests.gpu_helpers import compiled_and_reference, kernels_keep_the_losses


@pytest.mark.gpu
def test_seq_attention_compiled_on_cuda_matches_the_reference():
    from fasttrain.kernels.seq_attention import seq_attention, seq_attention_reference

    torch.manual_seed(0)
    # ViT-B/16's 197 tokens (three blocks of 64 and a partial one) and 12 heads of 64
    qkv = torch.randn(16, 197, 3 * 768, device="cuda", dtype=torch.bfloat16)
    cot = torch.randn(16, 197, 768, device="cuda")
    compiled_and_reference(lambda q: seq_attention(q, 12),
                            lambda q: seq_attention_reference(q, 12), [qkv],
                            lambda out: (out.float() * cot).sum())
    # the projection with its bias, whose gradient the backward kernels sum
    from fasttrain.kernels.seq_attention import (projected_seq_attention,
                                                 projected_seq_attention_reference)
    x = torch.randn(16, 197, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3 * 768, 768, device="cuda", dtype=torch.bfloat16) / 28
    b = 0.2 * torch.randn(3 * 768, device="cuda", dtype=torch.bfloat16)
    compiled_and_reference(lambda *a: projected_seq_attention(*a, 12),
                            lambda *a: projected_seq_attention_reference(*a, 12), [x, w, b],
                            lambda out: (out.float() * cot).sum())


@pytest.mark.gpu
def test_vit_attention_kernel_in_the_graphed_training_loop_keeps_the_losses():
    kernels_keep_the_losses("vit", Recipe(precision="bf16-mixed", optimizer_impl="fused",
                                           compile="model", cuda_graphs=True),
                             ("attention", "attention,layernorm,gelu"),
                             "self-attention from the qkv projection's layout")

