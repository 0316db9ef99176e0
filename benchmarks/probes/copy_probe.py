"""Which host-side op launches each copy kernel of a training step (one GPU, eager step).

CUDA-graph traces show a step's copy kernels (``direct_copy``, ``CatArrayBatchedCopy``) but
not who asked for them. This probe prepares the workload with a preset as the loop does, with
CUDA graphs off, runs three steps, then profiles one with shapes. Every op whose kernels include a
copy is a row: the op, its inputs' shapes (and strides where the profiler records them; the
H200's torch 2.11 did not), the ops around it
(``aten::convolution_backward`` inside a compiled backward, AOTAutograd's
``CompiledFunctionBackward`` checking an incoming gradient, autograd's ``SplitWithSizesBackward``,
...), its calls and µs of copy kernels; and a total row: all of them (``copy_us``, which
counts Inductor's fused kernels with ``_to_copy`` in their names too) and ATen's alone
(``aten_copy_us``). Rows in ``$OUT/copy-probe-<tag>.jsonl``.

    OUT=/tmp/x PYTHONPATH=src python3 benchmarks/probes/copy_probe.py sd \
        benchmarks/results/presets/sd-base-layernorm.toml
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time
import tomllib

import torch
from torch.profiler import ProfilerActivity, profile

from fasttrain.measure.env import environment
from fasttrain.recipe import Recipe
from fasttrain.run.data import make_loader, to_device
from fasttrain.run.loop import prepare
from fasttrain.workloads import load_workload


def _copies(e) -> list:
    """The copy kernels ``e`` launched itself (not its children)."""
    return [k for k in e.kernels if "copy" in k.name.lower() or "CatArray" in k.name]


def _site(e) -> dict:
    """What called a copy: the op, its inputs, the ops around it."""
    chain, p = [], e.cpu_parent
    while p is not None and len(chain) < 4:
        chain.append(p.name[:90])
        p = p.cpu_parent
    return {"op": e.name, "shapes": [list(s) for s in e.input_shapes[:2]],
            "strides": [list(s) for s in (getattr(e, "structured_input_strides", None)
                                            or getattr(e, "input_strides", None) or [])[:2]],
            "within": chain}


def prepared(workload: str, preset: str):
    """(state, workload, one batch on the GPU): the base size of ``workload`` prepared with
    ``preset`` as the training loop does, with CUDA graphs off (the host ops must run to be
    seen, and the parts of a step can be captured one by one)."""
    rec = tomllib.load(open(preset, "rb"))["recipe"]
    rec["cuda_graphs"] = False
    wl = load_workload(workload, size="base", seed=0)
    dev = torch.device("cuda")
    state, dataset, _ = prepare(wl, Recipe(**rec), dev, total_steps=1000)
    loader = iter(make_loader(wl, state.micro_batch, 0, dataset=dataset, collate=state.collate,
                              **state.loader_kwargs))
    return state, wl, to_device(next(loader), dev, False)


def main() -> int:
    workload = sys.argv[1] if len(sys.argv) > 1 else "sd"
    preset = sys.argv[2] if len(sys.argv) > 2 else "benchmarks/results/presets/sd-base-layernorm.toml"
    tag = os.environ.get("TAG", "run")
    out = os.environ.get("OUT", "/tmp")
    t0 = time.time()
    state, wl, batch = prepared(workload, preset)
    dev = state.device
    count = wl.count(batch)

    def step() -> None:
        with state.step_context():
            loss = wl.loss(state.model, batch) / count
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    sites: dict[str, dict] = collections.defaultdict(lambda: {"calls": 0, "us": 0.0})
    for e in prof.events():
        ks = _copies(e)
        if not ks:
            continue
        site = _site(e)
        row = sites[json.dumps(site)]
        row.update(site, kernel=ks[0].name[:100])
        row["calls"] += 1
        row["us"] += sum(k.duration for k in ks)
    env = environment(dev)
    rows = sorted(sites.values(), key=lambda r: -r["us"])
    base = {"kind": "copy-probe", "workload": workload, "preset": os.path.basename(preset),
            "tag": tag, "git_sha": env.get("git_sha"), "env": env}
    aten = [r for r in rows if not r["kernel"].startswith("triton")]  # not Inductor's fusions
    total = {**base, "kind": "copy-probe-total", "copy_us": round(sum(r["us"] for r in rows), 1),
             "copy_kernels": sum(r["calls"] for r in rows),
             "aten_copy_us": round(sum(r["us"] for r in aten), 1),
             "aten_copy_kernels": sum(r["calls"] for r in aten), "warm_s": round(warm_s, 1)}
    with open(os.path.join(out, f"copy-probe-{tag}.jsonl"), "a") as f:
        for r in [total, *({**base, **r, "us": round(r["us"], 1)} for r in rows)]:
            f.write(json.dumps(r) + "\n")
    print(json.dumps({k: v for k, v in total.items() if k != "env"}))  # the rows carry it
    for r in rows[:25]:
        print(round(r["us"]), r["calls"], r["op"], r["shapes"][:1], r["strides"][:1],
              r["within"][:2])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
