"""Where SD's frozen half (VAE encoder + CLIP text encoder) spends its time, kernel by kernel,
with the source Inductor generated for its largest kernels (one H200).

The preset ``presets/sd-base-master-weights.toml`` (or ``PRESET``) is prepared as the loop does;
the frozen ``encode()`` runs a few times, then twice under torch.profiler. Rows in
``$OUT/encode-probe.jsonl``: one per kernel name (calls and µs per encode), and a total. For
every Inductor kernel above ``MIN_US`` µs per encode, its Triton source and the ``call``
function that launches it are copied to ``$OUT/encode-code/<kernel>.py`` (read from the
Inductor cache this run wrote under ``$OUT/inductor-cache``, removed afterwards).

    OUT=/tmp/x PYTHONPATH=src python3 benchmarks/probes/sd_encode_probe.py
"""
import collections
import json
import os
import shutil
import time
import tomllib
from pathlib import Path

out = Path(os.environ.get("OUT", "/tmp"))
cache = out / "inductor-cache"
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # before torch: every source file lands here
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from fasttrain.measure.env import environment
from fasttrain.recipe import Recipe  # noqa: E402
from fasttrain.run.data import make_loader, to_device  # noqa: E402
from fasttrain.run.loop import prepare  # noqa: E402
from fasttrain.workloads import load_workload  # noqa: E402

MIN_US = float(os.environ.get("MIN_US", "150"))
preset = os.environ.get("PRESET", "benchmarks/results/presets/sd-base-master-weights.toml")
with open(preset, "rb") as f:
    rec = tomllib.load(f)["recipe"]
rec["cuda_graphs"] = False
recipe = Recipe(**rec)
wl = load_workload("sd", size=os.environ.get("SIZE", "base"), seed=0)
dev = torch.device("cuda")
t0 = time.time()
state, dataset, _ = prepare(wl, recipe, dev, total_steps=1000)
m = getattr(state.model, "_orig_mod", state.model)
loader = iter(make_loader(wl, state.micro_batch, 0, dataset=dataset, collate=state.collate,
                          **state.loader_kwargs))
b = to_device(next(loader), dev, False)


def encode():
    with state.step_context():
        return m.encode(b["images"], b["input_ids"], b["posterior_noise"])


for _ in range(3):
    encode()
torch.cuda.synchronize()
print("prepared and warmed up", round(time.time() - t0), "s", flush=True)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(2):
        encode()
    torch.cuda.synchronize()
kernels = collections.defaultdict(lambda: [0, 0.0])
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
        k = kernels[e.name]
        k[0] += 1
        k[1] += e.device_time_total
env = environment(dev)
rows = [{"kind": "encode-probe", "kernel": name, "calls": n // 2, "us": us / 2,
         "preset": preset, "env": env}
        for name, (n, us) in sorted(kernels.items(), key=lambda x: -x[1][1])]
total = sum(r["us"] for r in rows)
rows.append({"kind": "encode-probe", "kernel": "(all kernels)", "us": total, "preset": preset,
             "batch": state.micro_batch, "env": env})
with open(out / "encode-probe.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
for r in rows[:40]:
    print(f"{r['us']:9.1f} us {r.get('calls', ''):>4} {r['kernel'][:120]}")
print(f"total {total / 1000:.2f} ms an encode", flush=True)

code = out / "encode-code"
code.mkdir(exist_ok=True)
wanted = {r["kernel"]: r for r in rows if r["kernel"].startswith("triton_") and r["us"] >= MIN_US}
for p in cache.rglob("*.py"):  # each generated file read once
    if not wanted or p.stat().st_size >= 4_000_000:
        continue
    text = p.read_text(errors="replace")
    for name in [n for n in wanted if f"def {n}(" in text]:
        r = wanted.pop(name)
        start = text.rfind("async_compile.triton(", 0, text.find(f"def {name}("))
        end = text.find("''', device_str=", start)
        at = text.find("def call(")
        (code / f"{name}.py").write_text(
            f"# from {p.name}; {r['us']:.1f} us an encode, {r['calls']} calls\n"
            + text[start:end] + "\n\n# ---- call()\n" + (text[at:at + 20000] if at >= 0 else ""))
shutil.rmtree(cache, ignore_errors=True)
print("code of", len(list(code.iterdir())), "kernels in", code, flush=True)
