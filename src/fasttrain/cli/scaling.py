"""``fasttrain scaling``: per-GPU throughput and memory at 1/2/4/8 processes."""
from __future__ import annotations

from ..errors import FasttrainError
from .common import _base_recipe, _device, _out_path


def cmd_scaling(args) -> int:
    from ..ladder.scaling import run_scaling
    from ..report.live import default_console
    from ..workloads import load_workload

    if args.nproc > 1 or args.nnodes > 1:
        raise FasttrainError("scaling sets the process counts itself: use --worlds 1,2,4,8")
    device = _device(args.device)
    size = args.size or ("base" if device.startswith("cuda") else "tiny")
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        raise FasttrainError(f"--worlds expects numbers like 1,2,4,8, got {args.worlds!r}") from None
    if 1 not in worlds or min(worlds) < 1:
        raise FasttrainError("--worlds must be process counts >= 1 and include 1 (the "
                             "single-process reference)")
    if args.per_gpu_batch is not None and args.per_gpu_batch < 1:
        raise FasttrainError("--per-gpu-batch must be >= 1 (leave it out for the workload's "
                             "default)")
    modes = [m.strip() for m in args.sharding.split(",") if m.strip()]
    recipe = _base_recipe(args)
    per_gpu = args.per_gpu_batch or load_workload(args.workload, size).default_batch
    out = _out_path(args, "scaling", size)
    console = default_console()

    def show(row):
        if row.get("error"):
            console.print(f"  {row['rung']:>10}: error: {row['error']}")
            return
        eff = f"{row['efficiency']:.0%}" if row.get("efficiency") else "–"
        mem = row.get("peak_allocated_gib")
        par = row.get("parity")
        check = "" if not par else (f", parity {'✓' if par['passed'] else '✗'} "
                                    f"{par['max_rel_dev']:.1e} vs {par['against']}"
                                    if par.get("max_rel_dev") is not None else ", parity ✗")
        console.print(f"  {row['rung']:>10}: {row['throughput']:,.1f} {row['throughput_unit']} "
                      f"per GPU, efficiency {eff}, peak/GPU "
                      f"{'–' if mem is None else f'{mem:.2f} GiB'}{check}")

    run_scaling(args.workload, size, recipe, worlds, modes, per_gpu, device, args.steps,
                args.warmup, out, show, args.rung_timeout)
    print(f"rows: {out}")
    return 0
