"""Accelerate with fasttrain's fused kernels: a transformers Llama converted in place, then
prepared by ``Accelerator`` as usual.

    python -m examples.convert_accelerate
"""
from __future__ import annotations

import torch


def main(steps: int = 3, convert: bool = True, tiny: bool = True) -> tuple[list[float], str]:
    """Train ``steps`` steps of a (tiny) Llama with Accelerate; returns the losses and what
    convert did."""
    import transformers
    from accelerate import Accelerator

    import fasttrain
    from fasttrain.peers.hf_llama_peer import LLAMA_1B, TINY, llama_config

    accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no")
    torch.manual_seed(0)
    config = llama_config(transformers, TINY if tiny else LLAMA_1B)
    model = transformers.LlamaForCausalLM(config).to(accelerator.device)
    kernels = "fused" if accelerator.device.type == "cuda" else "none"
    report = fasttrain.convert(model, kernels=kernels).summary() if convert else "not converted"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (2 * steps, 64), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(ids, batch_size=2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses = []
    for batch in loader:
        loss = model(input_ids=batch, labels=batch).loss  # no attention_mask: the fused path
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, report


if __name__ == "__main__":
    losses, report = main()
    print(report)
    print("losses:", [round(x, 4) for x in losses])
