"""How much of SD's optimizer step hides behind the frozen encoders on a second stream (one
H200, CUDA graphs). The workload is prepared with ``presets/sd-base-layernorm.toml`` (CUDA
graphs off, so that the parts can be captured one by one), every trainable weight is given a
fixed random gradient, and these are captured and replayed (15 timed replays, twice):
the encoders (VAE + CLIP) alone, the one-launch AdamW alone, both one after the other, and both
on two streams, each part on either stream, at normal and high priority. Rows (``kind``
overlap-probe, the median, min and max ms of a replay) in ``$OUT/overlap-probe.jsonl``.

    OUT=/tmp/x PYTHONPATH=src python3 benchmarks/overlap_probe.py
"""
import json
import os
import time
import tomllib
import torch
from fasttrain.env import environment
from fasttrain.recipe import Recipe
from fasttrain.run.data import make_loader, to_device
from fasttrain.run.loop import prepare
from fasttrain.workloads import load_workload

out = os.environ.get("OUT", "/tmp")
preset = "benchmarks/results/presets/sd-base-layernorm.toml"
rec = tomllib.load(open(preset, "rb"))["recipe"]
rec["cuda_graphs"] = False
recipe = Recipe(**rec)
wl = load_workload("sd", size="base", seed=0)
dev = torch.device("cuda")
t0 = time.time()
state, dataset, _ = prepare(wl, recipe, dev, total_steps=1000)
loader = iter(make_loader(wl, state.micro_batch, 0, dataset=dataset, collate=state.collate,
                          **state.loader_kwargs))
b = to_device(next(loader), dev, False)
model, opt = state.model, state.optimizer
params = [p for p in state.trainable.parameters() if p.requires_grad]
for p in params:
    p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3).to(p.dtype)
print("prepared", time.time() - t0, flush=True)
lat = {}
def encode():
    with state.step_context():
        l, c = model.encode(b["images"], b["input_ids"], b["posterior_noise"])
    lat["l"], lat["c"] = l, c
for _ in range(3):
    encode(); opt.step()
torch.cuda.synchronize()
print("warm", time.time() - t0, flush=True)
rows = []
env = environment()
def capture(name, body):
    opt.step()  # an eager step between captures (FlatAdamW's spare table)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        body()
    return g
def two(first, second, prio):
    def body():
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream(priority=prio)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            second()
        first()
        main.wait_stream(side)
    return body
side_mem = {}
variants = {
    "encode": encode,
    "optimizer": opt.step,
    "serial": lambda: (encode(), opt.step()),
    "enc_side_opt_main": two(opt.step, encode, 0),
    "opt_side_enc_main": two(encode, opt.step, 0),
    "enc_side_hi_opt_main": two(opt.step, encode, -1),
    "opt_side_hi_enc_main": two(encode, opt.step, -1),
}
graphs = {k: capture(k, v) for k, v in variants.items()}
for rnd in range(2):
    for k, g in graphs.items():
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(15):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); g.replay(); e.record(); e.synchronize()
            ts.append(s.elapsed_time(e))
        ts.sort()
        row = {"kind": "overlap-probe", "variant": k, "round": rnd, "median_ms": ts[len(ts)//2],
               "min_ms": ts[0], "max_ms": ts[-1], "env": env}
        print(json.dumps(row), flush=True)
        rows.append(row)
with open(os.path.join(out, "overlap-probe.jsonl"), "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
