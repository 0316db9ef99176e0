"""``fasttrain profile``: where a step's time and memory go, and the recipe it suggests."""
from __future__ import annotations

from ..errors import FasttrainError
from .common import _base_recipe, _device, _file_target, _options, _out_path


def cmd_profile(args) -> int:
    from ..measure.files import write_atomic
    from ..measure.rows import append_row
    from ..profile.advisor import Finding, suggest_recipe
    from ..profile.runner import run_profile
    from ..recipe import to_toml
    from ..report.live import default_console
    from ..report.profile import render
    from ..workloads import load_workload

    device = _device(args.device)
    size = args.size or ("base" if device.startswith("cuda") else "tiny")
    if args.steps < 2 or args.active < 1 or args.warmup < 0:
        raise FasttrainError("profile: --steps must be >= 2, --active >= 1, --warmup >= 0")
    if args.suggest_recipe:
        _file_target(args.suggest_recipe, "--suggest-recipe")
    recipe = _base_recipe(args)
    wl = load_workload(args.workload, size, seed=recipe.seed, data=args.data, **_options(args.opt))
    folder = _out_path(args, "profile", size, suffix="")
    snap = folder / "memory-snapshot.pickle" if args.memory_snapshot else None
    row = run_profile(wl, recipe, device, steps=args.steps, warmup=args.warmup,
                      active=args.active, trace_dir=folder, snapshot=snap)
    from ..distributed.env import current

    if not current().main:  # every rank profiles; rank 0 reports
        return 0
    append_row(folder / "profile.jsonl", row)
    default_console().print(render(row))
    print(f"row: {folder / 'profile.jsonl'}")
    if args.suggest_recipe:
        findings = [Finding(**f) for f in row["findings"]]
        better = suggest_recipe(recipe, findings)
        note = "\n".join(f"{f.rule}: {f.evidence}" for f in findings) or "no findings"
        write_atomic(args.suggest_recipe, to_toml(better, comment=f"fasttrain profile "
                                                  f"{args.workload} {size}\n{note}"))
        print(f"suggested recipe: {args.suggest_recipe} "
              f"(measure it: fasttrain ladder {args.workload} --recipe {args.suggest_recipe})")
    return 0
