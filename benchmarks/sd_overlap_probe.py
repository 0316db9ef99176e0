"""Does the frozen encoders' work for the next batch overlap SD's optimizer step? (one H200)

SD's step runs the frozen VAE and text encoders, the UNet's forward and backward, then the
one-launch AdamW + EMA (7.6 ms, memory-bound). The encoders' output for batch t+1 does not depend
on step t's update, so they could run on a side stream alongside it. Each variant is one CUDA
graph of a whole step (the preset ``presets/sd-base-master-weights.toml`` without the loop's own
graphs), replayed 30 times; one JSONL row each (median of the last 25 replays) in
``$OUT/overlap-probe.jsonl``:

    seq               encode(t) -> UNet forward + backward(t) -> optimizer   (the library's step)
    after-backward    encode(t+1) on a side stream forked after the backward (beside the optimizer)
    after-backward-hi the same, side stream at high priority
    after-forward     forked after the forward (beside the backward and the optimizer)
    start             forked at the start (beside the whole step)

    PYTHONPATH=src python3 benchmarks/sd_overlap_probe.py
"""
import json
import os
import statistics
import time
import tomllib

import torch

from fasttrain.env import environment
from fasttrain.recipe import Recipe
from fasttrain.workloads import load_workload
from fasttrain.run.loop import prepare
from fasttrain.run.data import make_loader, to_device

out = os.environ.get("OUT", "/tmp")
with open("benchmarks/results/presets/sd-base-master-weights.toml", "rb") as f:
    rec = tomllib.load(f)["recipe"]
rec["cuda_graphs"] = False  # the probe captures its own graphs
recipe = Recipe(**rec)
wl = load_workload("sd", size=os.environ.get("SIZE", "base"), seed=0)
dev = torch.device("cuda")
t0 = time.time()
state, dataset, flops = prepare(wl, recipe, dev, total_steps=1000)
print("prepared", round(time.time() - t0), "s", type(state.model).__name__, flush=True)
model, opt = state.model, state.optimizer
m = getattr(model, "_orig_mod", model)
loader = iter(make_loader(wl, state.micro_batch, 0, dataset=dataset, collate=state.collate,
                          **state.loader_kwargs))
batches = [to_device(next(loader), dev, False) for _ in range(4)]
count = wl.count(batches[0])
ENV = environment(dev)


def encode(b, dst=None):
    with state.step_context():
        lat, ctx = m.encode(b["images"], b["input_ids"], b["posterior_noise"])
    if dst is None:
        return {"latents": lat, "context": ctx}
    dst["latents"].copy_(lat); dst["context"].copy_(ctx)
    return dst


def unet_loss(enc, b):
    with state.step_context():
        return m.denoise(enc["latents"], enc["context"], b["noise"], b["timesteps"]) / count


def run_variant(name, prio=0):
    fork = torch.cuda.Stream(priority=prio)
    static = {k: v.clone() for k, v in batches[0].items()}      # batch t (unet side)
    static_next = {k: v.clone() for k, v in batches[1].items()}  # batch t+1 (encoder side)
    enc_cur = {k: v.clone() for k, v in encode(static).items()}
    enc_next = {k: v.clone() for k, v in enc_cur.items()}

    def core():
        main = torch.cuda.current_stream()
        if name == "seq":
            loss = unet_loss(encode(static), static)
            loss.backward()
            opt.step()
            return loss.detach()
        if name == "start":
            fork.wait_stream(main)
            with torch.cuda.stream(fork):
                encode(static_next, enc_next)
        loss = unet_loss(enc_cur, static)
        if name == "after-forward":
            fork.wait_stream(main)
            with torch.cuda.stream(fork):
                encode(static_next, enc_next)
        loss.backward()
        if name in ("after-backward", "after-backward-hi"):
            fork.wait_stream(main)
            with torch.cuda.stream(fork):
                encode(static_next, enc_next)
        opt.step()
        main.wait_stream(fork)
        for k in enc_cur:
            enc_cur[k].copy_(enc_next[k])
        return loss.detach()

    side = torch.cuda.Stream()
    for _ in range(3):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            opt.zero_grad(set_to_none=True)
            core()
        torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        loss = core()
    times = []
    for i in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    ms = [a.elapsed_time(b) for a, b in times][5:]
    row = {"kind": "overlap-probe", "variant": name + (" (high priority)" if prio else ""),
           "ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
           "img_per_s": state.micro_batch / statistics.median(ms) * 1000,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "env": ENV}
    print(json.dumps(row), flush=True)
    with open(f"{out}/overlap-probe.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    del g, loss
    torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()


hi = torch.cuda.Stream.priority_range()[1]  # the highest priority (a negative number)
for name, prio in [("seq", 0), ("after-backward", 0), ("after-backward-hi", hi),
                   ("after-forward", 0), ("start", 0), ("seq", 0), ("after-backward", 0)]:
    t1 = time.time()
    run_variant(name, prio)
    print(name, "took", round(time.time() - t1), "s", flush=True)
