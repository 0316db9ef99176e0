"""``fasttrain fit``: the largest batch that really fits, re-verified."""
from __future__ import annotations

from ..errors import FasttrainError
from .common import _base_recipe, _device, _options, _out_path


def cmd_fit(args) -> int:
    from rich.table import Table

    from ..measure.env import environment
    from ..fit.search import FitSpec, fit
    from ..measure.rows import append_row
    from ..report.live import default_console

    device = _device(args.device)
    size = args.size or ("base" if device.startswith("cuda") else "tiny")
    if args.nproc > 1 or args.nnodes > 1:
        raise FasttrainError("fit searches the batch of one process; --nproc is for train, "
                             "profile and ladder")
    if not 0 <= args.headroom < 0.9 or args.max_batch < 1 or args.multiple_of < 1:
        raise FasttrainError("fit: --headroom must be in [0, 0.9), --max-batch and "
                             "--multiple-of >= 1")
    if args.memory_budget is not None and args.memory_budget <= 0:
        raise FasttrainError("fit: --memory-budget must be > 0 GiB")
    spec = FitSpec(workload=args.workload, size=size, recipe=_base_recipe(args), device=device,
                   budget_gib=args.memory_budget, max_batch=args.max_batch,
                   headroom=args.headroom, objective=args.objective, steps=args.steps,
                   multiple_of=args.multiple_of,
                   warmup=args.warmup, data=args.data, options=_options(args.opt))
    out = _out_path(args, "fit", size)
    console, env = default_console(), environment(device)

    def on_trial(row):
        mark = "pass" if row["passed"] else f"fail: {row['error']}"
        peak = f"{row['peak_gib']:.2f} GiB" if row.get("peak_gib") is not None else "–"
        step = f"{row['step_time_s'] * 1e3:,.1f} ms" if row.get("step_time_s") else "–"
        console.print(f"  trial batch {row['batch']:>6} ckpt={row['recipe']['checkpointing']:<9}"
                      f" peak {peak:>11}  step {step:>10}  {mark}")
        append_row(out, {**row, "env": env})

    console.print(f"fasttrain fit · {args.workload} {size} · {device} · budget "
                  f"{spec.budget_gib or 'device'} GiB, headroom {spec.headroom:.0%}")
    ans = fit(spec, on_trial)
    table = Table(title="answer (re-verified in a fresh process)", header_style="bold")
    for col in ("batch", "checkpointing", "peak GiB", "ms/step", "throughput", "trials"):
        table.add_column(col, justify="right")
    table.add_row(str(ans["batch"]), ans["recipe"]["checkpointing"], f"{ans['peak_gib']:.2f}",
                  f"{ans['step_time_s'] * 1e3:,.1f}", f"{ans['throughput']:,.1f} "
                  f"{ans['throughput_unit']}", str(ans["trials"]))
    console.print(table)
    append_row(out, {**ans, "answer": True, "env": env})
    print(f"rows: {out}")
    return 0
