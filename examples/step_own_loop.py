"""Your own training loop, its step made fast by ``fasttrain.Step``: a nanoGPT-style GPT
(examples/gpt.py) trained by a plain loop. Only the loop's body changes.

    python -m examples.step_own_loop            # tiny GPT, on a GPU if there is one
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from examples.gpt import GPT, SIZES, RandomTokens


def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))


def main(steps: int = 6, use_step: bool = True, size: str = "tiny", batch: int = 4,
         device: str | None = None) -> tuple[list[float], str]:
    """Train ``steps`` steps; returns the losses and what the step did."""
    import fasttrain

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = SIZES[size]
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    data = RandomTokens(cfg)
    loader = torch.utils.data.DataLoader(
        [(d["x"], d["y"]) for d in (data[i] for i in range(len(data)))], batch_size=batch,
        drop_last=True)  # one batch shape: the CUDA graph keeps replaying
    batches = iter(loader)
    first = next(iter(loader))
    if use_step:
        step = fasttrain.Step(model, optimizer, loss_fn, first, recipe={"compile": "none"})
    losses = []
    for _ in range(steps):
        x, y = (t.to(device) for t in next(batches))
        if use_step:
            loss = step((x, y))
        else:  # the loop as you wrote it
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = loss_fn(model, (x, y))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(float(loss.detach()))
    return losses, repr(step) if use_step else "plain loop"


if __name__ == "__main__":
    losses, report = main()
    print(report)
    print("losses:", [round(x, 4) for x in losses])
