"""``fasttrain train``: one measured run of a recipe, its checkpoints (--save, --resume,
--export) and its row."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..errors import FasttrainError
from .common import _base_recipe, _device, _error, _file_target, _options, _out_path


def _resume_from(args) -> str | None:
    """--resume DIR as given; ``auto``: the newest complete save of --save DIR, or none (a
    first start, or a first save that was cut off), said on one line."""
    if args.resume != "auto":
        return args.resume
    if not args.save:
        raise FasttrainError("--resume auto continues the newest save of --save DIR; give --save")
    from ..run.checkpoint import latest

    found = latest(args.save)
    if os.environ.get("RANK", "0") == "0":  # rank 0 of a torchrun job, or not under one
        print(f"resume: {'continuing ' + str(found) if found else 'no complete save in '}"
              f"{'' if found else args.save + ' yet: starting from step 0'}", file=sys.stderr)
    return str(found) if found else None


def _checkpoint_record(args, resumed: Path | None) -> dict | None:
    """The row's account of its checkpoints: the save it continued, the newest it wrote (with
    how many step folders --save now keeps), the exported file."""
    if not (args.save or resumed):
        return None
    from ..run.checkpoint import latest
    from ..run.step_folders import step_folders

    saved = latest(args.save) if args.save else None
    return {"resumed_from": str(resumed) if resumed else None,
            "saved": str(saved) if saved else None,
            "kept": len(step_folders(Path(args.save))) if args.save else 0,
            "exported": args.export or None}


def cmd_train(args) -> int:
    from ..run.loop import train
    from ..workloads import load_workload

    device = _device(args.device)
    size = args.size or ("base" if device.startswith("cuda") else "tiny")
    recipe = _base_recipe(args)
    if args.export and not args.save:
        raise FasttrainError("--export consolidates the checkpoint of --save; give both")
    if args.save_every and not args.save:
        raise FasttrainError("--save-every saves into the folder of --save; give both")
    if args.save_every < 0:
        raise FasttrainError(f"--save-every must be 0 or more (0: only at the end), not "
                             f"{args.save_every}")
    if args.keep < 1:
        raise FasttrainError(f"--keep must be 1 or more (the newest step folders kept), not "
                             f"{args.keep}")
    if args.export:
        _file_target(args.export, "--export")
    resume = _resume_from(args)
    out = _out_path(args, "train", size)  # a wrong --out is refused before the run
    options = _options(args.opt)
    wl = load_workload(args.workload, size, seed=recipe.seed, data=args.data, **options)
    from ..distributed.env import current
    from ..run.checkpoint import resolve
    from ..run.saving import Stopped

    resumed = resolve(resume) if resume else None  # before this run's saves join it

    try:
        res = train(wl, recipe, steps=args.steps, warmup=args.warmup, device=device,
                    save_to=args.save, resume_from=str(resumed) if resumed else None,
                    save_every=args.save_every,
                    keep=args.keep)
    except Stopped as stop:  # SIGINT/SIGTERM: saved after the step under way
        if current().main:
            print(stop, file=sys.stderr)
        return stop.exit_code
    if not current().main:
        return 0
    if args.export:
        from ..run.checkpoint import export

        export(args.save, args.export)
    from ..measure.env import environment
    from ..measure.rows import append_row, make_row

    name = args.preset or (Path(args.recipe).stem if args.recipe else "default")
    row = make_row("train", args.workload, size, None, options=options, device=device,
                   recipe_name=name, recipe=recipe.to_dict(), **res.to_row(),
                   checkpoint=_checkpoint_record(args, resumed), env=environment(device))
    append_row(out, row)
    if args.tensorboard:
        from ..report.tensorboard import write_scalars

        write_scalars([{**row, "rung": out.stem}], args.tensorboard)
    if args.json:
        print(json.dumps(row, indent=1))
    else:
        from ..recipe import Recipe
        from ..report.live import default_console
        from ..report.train import train_summary

        default_console().print(train_summary(row, str(out), Recipe().to_dict()))
    bad = res.failed_step()  # fp16: a step the GradScaler skipped and recovered from passes
    if bad is not None:  # the row is written above; the run itself failed
        return _error(f"the loss became {res.losses[bad - 1]} at step {bad} of "
                      f"{len(res.losses)}: lower the learning rate or check the data and the "
                      "loss", 1)
    return 0
