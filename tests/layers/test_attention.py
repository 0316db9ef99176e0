"""layers/attention.py: what the compiled attention layers read of SDPA's settings."""
import torch

from fasttrain.layers import attention


def test_the_flash_flag_is_read_without_a_graph_break():
    """native_gqa reads SDPA's flash flag inside compiled models: through the C function that
    Dynamo folds to a constant, so the attention layers stay in one graph."""
    assert attention.flash_enabled() == torch.backends.cuda.flash_sdp_enabled()

    def pick(x):
        return x + 1 if attention.flash_enabled() else x - 1

    torch._dynamo.reset()
    assert torch._dynamo.explain(pick)(torch.ones(2)).graph_break_count == 0
