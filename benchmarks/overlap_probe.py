"""How much of SD's optimizer step hides behind the frozen encoders on a second stream (one
H200, CUDA graphs). The workload is prepared with ``presets/sd-base-layernorm.toml`` (CUDA
graphs off, so that the parts can be captured one by one; ``copy_probe.prepared``), every
trainable weight is given a fixed random gradient, and these are captured and replayed (15
timed replays, twice): the encoders (VAE + CLIP) alone, the one-launch AdamW alone, both one
after the other, and both on two streams, each part on either stream, at normal and high
priority. Rows (``kind`` overlap-probe, the median, min and max ms of a replay) in
``$OUT/overlap-probe.jsonl``.

    OUT=/tmp/x PYTHONPATH=src python3 benchmarks/overlap_probe.py
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from copy_probe import prepared  # noqa: E402
from fasttrain.env import environment  # noqa: E402


def _on_two_streams(first, second, priority: int):
    """A capture body: ``second`` on a side stream of ``priority`` while ``first`` runs."""
    def body():
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream(priority=priority)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            second()
        first()
        main.wait_stream(side)
    return body


def _replay_ms(graph: torch.cuda.CUDAGraph, times: int = 15) -> list[float]:
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    ms = []
    for _ in range(times):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    return sorted(ms)


def main() -> int:
    state, _, b = prepared("sd", "benchmarks/results/presets/sd-base-layernorm.toml")
    model, opt = state.model, state.optimizer
    for p in state.trainable.parameters():
        if p.requires_grad:
            p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3).to(p.dtype)

    def encode():
        with state.step_context():
            model.encode(b["images"], b["input_ids"], b["posterior_noise"])

    for _ in range(3):  # compile the encoders, warm the optimizer
        encode()
        opt.step()
    variants = {
        "encode": encode,
        "optimizer": opt.step,
        "serial": lambda: (encode(), opt.step()),
        "enc_side_opt_main": _on_two_streams(opt.step, encode, 0),
        "opt_side_enc_main": _on_two_streams(encode, opt.step, 0),
        "enc_side_hi_opt_main": _on_two_streams(opt.step, encode, -1),
        "opt_side_hi_enc_main": _on_two_streams(encode, opt.step, -1),
    }
    graphs = {}
    for name, body in variants.items():
        opt.step()  # an eager step between captures (FlatAdamW's spare table)
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name], capture_error_mode="thread_local"):
            body()
    env, rows = environment(), []
    for rnd in range(2):
        for name, graph in graphs.items():
            ms = _replay_ms(graph)
            rows.append({"kind": "overlap-probe", "variant": name, "round": rnd,
                         "median_ms": ms[len(ms) // 2], "min_ms": ms[0], "max_ms": ms[-1],
                         "env": env})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "env"}), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "overlap-probe.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
