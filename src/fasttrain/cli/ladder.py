"""``fasttrain ladder``: the cumulative rungs, each with parity; ``--long``: the numerics
switches' loss curves against bf16-mixed's."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..errors import FasttrainError
from .common import _base_recipe, _device, _error, _options, _out_path


def cmd_ladder(args) -> int:
    from ..ladder.runner import LadderSpec, failures, run_ladder
    from ..report.live import show_progress
    from ..report.table import ratio_warning

    device = _device(args.device)
    size = args.size or ("base" if device.startswith("cuda") else "tiny")
    rungs = [r.strip() for r in args.rungs.split(",") if r.strip()]
    if not rungs:
        raise FasttrainError("--rungs names no rung: give rung names (fp32,bf16), 'default', "
                             "'memory', 'fast' or 'none'")
    if args.long:
        return _long(args, device, size, rungs)
    out = _out_path(args, "ladder", size)
    base = _base_recipe(argparse.Namespace(recipe=None, set=args.set, batch=args.batch))
    extra = []
    if args.recipe:  # the file is measured as its own rung against the fp32 baseline
        extra.append((Path(args.recipe).stem, _base_recipe(args)))
        if rungs == ["default"]:
            rungs = ["fp32"]
    if args.nnodes > 1:
        raise FasttrainError("ladder runs on one node (--nproc); start multi-node runs with "
                             "torchrun and fasttrain train")
    spec = LadderSpec(workload=args.workload, size=size, rungs=rungs, base=base,
                      steps=args.steps, warmup=args.warmup, device=device, data=args.data,
                      options=_options(args.opt), out=out, peer=args.peer and args.nproc == 1,
                      rung_timeout=args.rung_timeout, extra_rungs=extra, nproc=args.nproc,
                      start_at=args.start_at, confirm=args.confirm)
    if rungs == ["none"] and not spec.peer and not extra:
        raise FasttrainError("--rungs none runs only the peer: add --peer (one process), or "
                             "name rungs")
    if spec.peer:
        from ..peers import unavailable

        why = unavailable(spec.workload)
        if why:
            raise FasttrainError(f"--peer: the {why}; install it, or run without --peer")
    started = time.monotonic()
    try:
        rows = show_progress(lambda on_row, on_start: run_ladder(spec, on_row, on_start),
                             f"fasttrain ladder · {spec.workload} {spec.size} · {spec.device}")
    except KeyboardInterrupt:  # the rows finished so far are already in the file
        kept = (f"the rows finished so far are in {out}" if out.exists() and out.stat().st_size
                else "no row finished")
        print(f"fasttrain: interrupted: {kept}", file=sys.stderr)
        return 130
    if rungs == ["fast"]:
        from ..ladder.search import write_fast_preset

        print(write_fast_preset(args.workload, size, rows, out,
                                search_s=time.monotonic() - started))
    if ratio_warning(rows):
        print(f"warning: {ratio_warning(rows)}")
    if args.tensorboard:
        from ..report.tensorboard import write_scalars

        runs = write_scalars(rows, Path(args.tensorboard) / out.stem)
        print(f"tensorboard: {len(runs)} runs in {Path(args.tensorboard) / out.stem}")
    print(f"rows: {out}")
    failed = failures(rows)
    return _error(f"the ladder failed: {failed}", 1) if failed else 0


def _long(args, device: str, size: str, rungs: list[str]) -> int:
    """``ladder --long N``: the numerics switches' loss curves against bf16-mixed's."""
    from ..ladder.long_run import failures, long_plan, long_table, run_long
    from ..ladder.spec import LadderSpec
    from ..measure.curves import WINDOWS

    if args.long < 2 * WINDOWS or args.nproc > 1 or args.peer:
        raise FasttrainError(f"--long takes at least {2 * WINDOWS} steps (2,000 make the point), "
                             f"on one process, without --peer (got --long {args.long})")
    base = _base_recipe(args)  # --recipe/--preset and --set: the baseline, switches off
    names = None if rungs == ["default"] else rungs
    long_plan(base, names)  # a bad variant name is refused before anything runs
    spec = LadderSpec(workload=args.workload, size=size, base=base, steps=args.long,
                      warmup=args.warmup, device=device, data=args.data,
                      options=_options(args.opt), out=_out_path(args, "long", size),
                      rung_timeout=args.rung_timeout)
    print(f"fasttrain ladder --long {args.long} · {spec.workload} {size} · {device}", flush=True)
    rows = run_long(spec, names, lambda row, i, n: print(
        f"  {i + 1}/{n} {row['rung']}: " + (row.get("error") or row.get("skipped") or "done"),
        flush=True))
    print("\n".join(long_table(rows)))
    print(f"rows: {spec.out}")
    failed = failures(rows)
    return _error(f"the long run failed: {failed}", 1) if failed else 0
