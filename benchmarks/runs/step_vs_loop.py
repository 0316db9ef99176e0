"""Your own loop, plain against fasttrain.Step: the same model, batch and loss, each side in a
fresh process, in the order plain, Step, Step, plain (drift cancels in the pairs).

    python benchmarks/runs/step_vs_loop.py --model gpt --size base --out rows.jsonl
    python benchmarks/runs/step_vs_loop.py --model cnn --size tiny --device cpu --steps 3

The plain side is the loop a user writes with PyTorch best practice: bf16 autocast,
``AdamW(fused=True)``, ``clip_grad_norm_(1.0)``, ``zero_grad(set_to_none=True)`` and
``torch.compile(model)``. The Step side is the same loop with its body replaced by
``loss = step(batch)``, ``step = fasttrain.Step(model, RECIPE, loss_fn, batch)``. The models
are the examples' (examples/gpt.py, vit.py, cnn.py): the model code is not changed. Rows:
``kind: peer`` for the plain loop, ``kind: train`` for the Step, both with ``env``; the ratio of
the medians of the two pairs is printed.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LR = 1e-4


def _setup(model_name: str, size: str, device: str):
    import torch

    sys.path.insert(0, str(ROOT))
    wl = importlib.import_module(f"examples.{model_name}").make_workload(size=size)
    torch.manual_seed(0)
    with torch.device(device):
        model = wl.build_model()
    data = wl.dataset()
    items = [data[i % len(data)] for i in range(wl.default_batch)]
    batch = {k: v.to(device) for k, v in wl.collate(items).items()}
    count = float(wl.count(batch))

    def loss_fn(m, b):  # the mean loss a user's loop differentiates
        return wl.loss(m, b) / count

    return wl, model, batch, loss_fn, count


def _time(step, batch, steps: int, warmup: int, cuda: bool) -> tuple[list[float], list[float], float]:
    import torch

    t0 = time.perf_counter()
    for _ in range(warmup):
        step(batch)
    if cuda:
        torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    losses, times = [], []
    for _ in range(steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            losses.append(step(batch))
            b.record()
            times.append((a, b))
        else:
            t = time.perf_counter()
            losses.append(step(batch))
            times.append(time.perf_counter() - t)
    if cuda:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in times]
    return times, [float(x) for x in torch.stack(losses).float().cpu()], warm


def side(args) -> dict:
    """One side in this process; returns its row."""
    import torch

    from fasttrain.measure.env import environment
    from fasttrain.measure.rows import make_row

    cuda = args.device.startswith("cuda")
    wl, model, batch, loss_fn, count = _setup(args.model, args.size, args.device)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    recipe: dict = {}
    if args.side == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=cuda or None)
        compiled = torch.compile(model) if args.compile else model
        params = list(model.parameters())

        def step(b):
            with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=cuda):
                loss = loss_fn(compiled, b)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        applied = {"loop": "bf16 autocast, AdamW(fused=True), clip 1.0, torch.compile(model)"
                   if args.compile else "bf16 autocast, AdamW(fused=True), clip 1.0, eager"}
    else:
        import fasttrain

        recipe = {"lr": LR, **json.loads(args.recipe)}
        if not args.compile:
            recipe["compile"] = "none"
        fstep = fasttrain.Step(model, recipe, loss_fn, batch)
        step = fstep
        applied = fstep.report()["applied"]
    torch.cuda.reset_peak_memory_stats() if cuda else None
    times, losses, warm = _time(step, batch, args.steps, args.warmup, cuda)
    med = statistics.median(times)
    kind = "peer" if args.side == "plain" else "train"
    row = make_row(kind, f"examples.{args.model}:make_workload", args.size,
                   "plain loop" if args.side == "plain" else "fasttrain.Step",
                   recipe=recipe or {"loop": "plain"}, batch=wl.default_batch, steps=args.steps,
                   step_time_s=med, step_time_min_s=min(times), step_time_max_s=max(times),
                   step_times_s=times, throughput=count / med, throughput_unit=f"{wl.unit}/s",
                   peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                   warmup_s=warm, losses=losses, applied=applied, error=None,
                   env=environment(args.device))
    if args.side == "step":
        row["step_report"] = {k: v for k, v in fstep.report().items() if k != "recipe"}
    return row


def drive(args) -> int:
    """The plain loop, then the Step under each recipe, then (with repeats) the Steps in reverse
    and the plain loop again, each in a fresh process; rows appended to ``args.out``."""
    from fasttrain.measure.rows import append_row

    recipes = args.recipe or ["{}"]
    order = [("plain", "{}")] + [("step", r) for r in recipes]
    if args.repeats:
        order += [("step", r) for r in reversed(recipes)] + [("plain", "{}")]
    rows: list[tuple[str, dict]] = []
    for which, recipe in order:
        cmd = [sys.executable, __file__, "--one", which, "--model", args.model, "--size",
               args.size, "--device", args.device, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--recipe", recipe] + ([] if args.compile else ["--no-compile"])
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{which} {recipe}: timed out after {args.timeout} s", flush=True)
            continue
        line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("{")), None)
        if done.returncode or line is None:
            print(f"{which} {recipe}: failed\n{done.stderr[-2500:]}", flush=True)
            continue
        row = json.loads(line)
        append_row(args.out, row)
        rows.append((recipe, row))
        print(f"{which:5s} {recipe:60s} {row['step_time_s'] * 1e3:8.2f} ms "
              f"{row['throughput']:10.1f} {row['throughput_unit']}  loss {row['losses'][-1]:.4f}",
              flush=True)
    plain = [r["step_time_s"] for _, r in rows if r["kind"] == "peer"]
    for recipe in recipes:
        mine = [r["step_time_s"] for rc, r in rows if r["kind"] == "train" and rc == recipe]
        if plain and mine:
            print(f"{args.model} {args.size} {recipe}: Step "
                  f"{statistics.median(plain) / statistics.median(mine):.3f}x the plain loop")
    return 0 if rows else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt", "vit", "cnn"), required=True)
    ap.add_argument("--size", default="base")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--recipe", action="append", help="JSON switches over Step's default "
                    "(repeat for several Step sides; default: Step's default recipe)")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--no-repeats", dest="repeats", action="store_false")
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--out", default="step-vs-loop.jsonl")
    ap.add_argument("--one", choices=("plain", "step"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        args.side, args.recipe = args.one, (args.recipe or ["{}"])[0]
        print(json.dumps(side(args)))
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
