"""Serve an exported package with torch alone: the proof that it deploys without fasttrain.

Run by path (``python serve_check.py PACKAGE IMAGES.pt OUT.pt BATCH ITERS WARMUP DEVICE``), so
that nothing of fasttrain is imported: it loads the AOTInductor package, runs every held-out
image through it (``BATCH`` at a time), times batch-1 latency and throughput the way the
inference ladder does, and saves the logits and the timings for the caller to check.
"""
import faulthandler
import os
import statistics
import sys
import time

import torch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(package, images_file, out_file, batch, iters, warmup, device):
    batch, iters, warmup, device = int(batch), int(iters), int(warmup), torch.device(device)
    faulthandler.enable()  # a crash inside the package's native code leaves its stack on stderr
    if device.type == "cuda":  # the CUDA context up before the package's runner is made
        torch.zeros(1, device=device)
    run = torch._inductor.aoti_load_package(package)
    images = torch.load(images_file, weights_only=True)["images"]
    assert not any(m == "fasttrain" or m.startswith("fasttrain.") for m in sys.modules), \
        "fasttrain was imported"
    with torch.inference_mode():
        logits = torch.cat([run(images[i:i + batch].to(device)).float().cpu()
                            for i in range(0, len(images), batch)])
        x = images[:batch].to(device)
        x = x.repeat((batch + len(x) - 1) // len(x), *[1] * (x.dim() - 1))[:batch]
        for _ in range(warmup):
            run(x)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        calls, t0 = [], time.perf_counter()
        for _ in range(iters):
            c0 = time.perf_counter()
            run(x)
            calls.append(time.perf_counter() - c0)
        _sync(device)
        total = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        lat = []
        for _ in range(warmup):
            run(x[:1])
        for _ in range(iters):
            _sync(device)
            c0 = time.perf_counter()
            run(x[:1])
            _sync(device)
            lat.append((time.perf_counter() - c0) * 1e3)
    q = statistics.quantiles(lat, n=10) if len(lat) > 1 else lat * 9
    got = {"logits": logits, "throughput": batch * iters / total, "step_time_s": total / iters,
           "peak_gib": peak,
           "latency_ms": {"p50": statistics.median(lat), "p90": q[8], "batch": 1}}
    tmp = f"{out_file}.tmp"  # then a rename: the caller reads all of it or none
    torch.save(got, tmp)
    os.replace(tmp, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:])
