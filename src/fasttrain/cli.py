"""Command line: parse, call the library, render. User mistakes are one line, exit status 2;
a run that fails (a ladder rung's error or parity, a train run's non-finite loss) exits 1."""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import sys
from pathlib import Path

from .errors import FasttrainError


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _options(items: list[str] | None) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise FasttrainError(f"--opt expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = _literal(v.strip())
    return out


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", nargs="?", default="vit",
                   help="vit | swin | sd | llama | package.module:factory (default vit)")
    p.add_argument("--size", default=None, help="tiny | base | large (default: base on CUDA, "
                   "tiny on CPU)")
    p.add_argument("--batch", type=int, default=None, help="samples per optimizer step")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps (default 5)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--recipe", default=None, help="TOML recipe file")
    p.add_argument("--preset", default=None,
                   help="a shipped preset (fasttrain presets lists them), or fast: the best "
                        "measured one for the workload on this GPU")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a switch")
    p.add_argument("--opt", action="append", metavar="KEY=VALUE", help="workload option")
    p.add_argument("--data", default=None, help="your image folder or token file")
    p.add_argument("--nproc", type=int, default=1,
                   help="processes per node, launched through torchrun (data parallel)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (with --rdzv-endpoint)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fasttrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    lad = sub.add_parser("ladder", help="measure cumulative speed-up rungs, each with parity")
    _common(lad)
    lad.add_argument("--rungs", default="default",
                     help="comma-separated rung names, 'default', 'memory', 'fast' (the preset "
                          "search), or 'none' (only --peer)")
    lad.add_argument("--from", dest="start_at", default=None, metavar="RUNG",
                     help="run the first rung (the parity base), then only the rungs from RUNG "
                          "on, their recipes still cumulative")
    lad.add_argument("--out", default="out", help="folder for the JSONL rows (default out/)")
    lad.add_argument("--peer", action="store_true",
                     help="also run the public-code peer (bf16 + fused AdamW + compile), then "
                          "the peer and the best rung once more (ours, peer, peer, ours) to "
                          "confirm the ratio")
    lad.add_argument("--no-confirm", dest="confirm", action="store_false",
                     help="with --peer: measure each side once, without the confirming repeats")
    lad.add_argument("--rung-timeout", type=float, default=None, help="seconds per rung")
    tr = sub.add_parser("train", help="one measured run of a recipe; prints its row")
    _common(tr)
    tr.add_argument("--save", default=None, metavar="DIR", help="write a DCP checkpoint after")
    tr.add_argument("--resume", default=None, metavar="DIR", help="continue a DCP checkpoint")
    tr.add_argument("--export", default=None, metavar="FILE",
                    help="consolidate the saved checkpoint into one torch.save file")
    pro = sub.add_parser("profile", help="where a step's time and memory go; what to switch on")
    _common(pro)
    pro.set_defaults(steps=10)
    pro.add_argument("--active", type=int, default=3, help="steps under torch.profiler")
    pro.add_argument("--out", default="out", help="folder for the row and the trace")
    pro.add_argument("--memory-snapshot", action="store_true",
                     help="record a memory-history snapshot (CUDA; pytorch.org/memory_viz)")
    pro.add_argument("--suggest-recipe", default=None, metavar="FILE.toml",
                     help="write the advice as a recipe that `fasttrain ladder --recipe` measures")
    fit = sub.add_parser("fit", help="the largest batch that really fits (re-verified)")
    _common(fit)
    fit.set_defaults(steps=2, warmup=1)
    fit.add_argument("--memory-budget", type=float, default=None, metavar="GiB",
                     help="memory budget (default: the GPU's memory; required on CPU)")
    fit.add_argument("--max-batch", type=int, default=4096)
    fit.add_argument("--multiple-of", type=int, default=1, metavar="N",
                     help="search only batches that are multiples of N (8 halves the trials "
                          "of a large search and keeps GEMM shapes friendly)")
    fit.add_argument("--objective", choices=("fit", "throughput"), default="fit")
    fit.add_argument("--headroom", type=float, default=0.05, help="fraction kept free (0.05)")
    fit.add_argument("--out", default="out", help="folder for the trial rows")
    sc = sub.add_parser("scaling", help="per-GPU throughput and memory at 1/2/4/8 processes")
    _common(sc)
    sc.add_argument("--worlds", default="1,2", help="process counts, e.g. 1,2,4,8")
    sc.add_argument("--sharding", default="ddp,zero2,zero3", help="modes for world > 1")
    sc.add_argument("--per-gpu-batch", type=int, default=None)
    sc.add_argument("--out", default="out")
    sc.add_argument("--rung-timeout", type=float, default=None)
    rep = sub.add_parser("report", help="render result rows (JSONL) as a table")
    rep.add_argument("rows", nargs="+")
    rep.add_argument("--markdown", action="store_true")
    sub.add_parser("workloads", help="list the registered workloads")
    sub.add_parser("presets", help="list the shipped presets and their measured speed-ups")
    return parser


def _out_path(args, kind: str, size: str, suffix: str = ".jsonl") -> Path:
    """``out/<kind>-<workload>-<size>-<time><suffix>`` (a module:factory made file-safe)."""
    _out_folder(args.out)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = args.workload.replace(":", "_").replace(".", "_")
    return Path(args.out) / f"{kind}-{name}-{size}-{stamp}{suffix}"


def _device(arg: str) -> str:
    """--device as the library resolves it: auto → cuda or cpu; an unknown device, or CUDA
    where there is none, is a one-line error."""
    from .run.loop import resolve_device

    dev = resolve_device(arg)
    return str(dev) if arg == "auto" else arg


def _check_common(args) -> None:
    """Values argparse accepts but no run can use: refused before anything starts."""
    if args.steps < 1 or args.warmup < 0:
        raise FasttrainError("--steps must be >= 1 and --warmup >= 0")
    if args.nproc < 1 or args.nnodes < 1:
        raise FasttrainError("--nproc and --nnodes must be >= 1")
    if args.batch is not None and args.batch < 1:
        raise FasttrainError("--batch must be >= 1 (leave it out for the workload's default)")
    if getattr(args, "rung_timeout", None) is not None and args.rung_timeout <= 0:
        raise FasttrainError("--rung-timeout must be > 0 seconds (leave it out for no limit)")


def _use_preset(args) -> None:
    """--preset NAME (or fast) becomes the shipped file as --recipe."""
    if not getattr(args, "preset", None):
        return
    if args.recipe:
        raise FasttrainError("give --preset or --recipe, not both")
    import torch

    from .presets import resolve

    device = _device(args.device)
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None
    size = args.size or ("base" if device.startswith("cuda") else "tiny")
    args.recipe = str(resolve(args.preset, args.workload, size, name).path)


def cmd_presets(args) -> int:
    from .presets import presets

    print(f"{'preset':20s} {'workload':34s} {'size':5s} {'GPU':5s} {'x peer':>7s}  rows")
    for p in presets().values():
        ratio = f"{p.ratio:.3f}x" if p.ratio is not None else "–"
        print(f"{p.name:20s} {p.workload:34s} {p.size:5s} {p.gpu:5s} {ratio:>7s}  {p.rows}")
    print("x peer: against PyTorch best practice (bf16 + fused AdamW + torch.compile) on the "
          "public model code, in one run; – not confirmed")
    return 0


def _out_folder(folder: str) -> None:
    """--out must be a folder this user can write (created if missing)."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise FasttrainError(f"--out {folder} is a file, not a folder: give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise FasttrainError(f"--out {folder}: cannot create the folder ({err.strerror}): "
                             "give a folder you can write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise FasttrainError(f"--out {folder} is not writable: give a folder you can write")


def _base_recipe(args):
    from .recipe import Recipe, load_toml, parse_sets

    base = load_toml(args.recipe) if args.recipe else Recipe()
    sets = parse_sets(args.set)
    if args.batch is not None:
        sets["batch"] = str(args.batch)
    return base.replace(**sets) if sets else base


def cmd_ladder(args) -> int:
    from .ladder.runner import LadderSpec, run_ladder
    from .report.live import show_progress
    from .report.table import ratio_warning

    device = _device(args.device)
    size = args.size or ("base" if device.startswith("cuda") else "tiny")
    rungs = [r.strip() for r in args.rungs.split(",") if r.strip()]
    if not rungs:
        raise FasttrainError("--rungs names no rung: give rung names (fp32,bf16), 'default', "
                             "'memory', 'fast' or 'none'")
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
    rows = show_progress(lambda on_row, on_start: run_ladder(spec, on_row, on_start),
                         f"fasttrain ladder · {spec.workload} {spec.size} · {spec.device}")
    if rungs == ["fast"]:
        from .ladder.search import write_fast_preset

        print(write_fast_preset(args.workload, size, rows, out))
    if ratio_warning(rows):
        print(f"warning: {ratio_warning(rows)}")
    print(f"rows: {out}")
    bad = [r for r in rows if r.get("kind") == "ladder" and (
        r.get("error") or (r.get("parity") or {}).get("passed") is False)]
    return 1 if bad else 0


def cmd_train(args) -> int:
    from .run.loop import train
    from .workloads import load_workload

    device = _device(args.device)
    size = args.size or ("base" if device.startswith("cuda") else "tiny")
    recipe = _base_recipe(args)
    if args.export and not args.save:
        raise FasttrainError("--export consolidates the checkpoint of --save; give both")
    options = _options(args.opt)
    wl = load_workload(args.workload, size, seed=recipe.seed, data=args.data, **options)
    res = train(wl, recipe, steps=args.steps, warmup=args.warmup, device=device,
                save_to=args.save, resume_from=args.resume)
    from .distributed.env import current

    if not current().main:
        return 0
    if args.export:
        from .run.checkpoint import export

        export(args.save, args.export)
    from .measure.env import environment

    from .measure.rows import make_row

    print(json.dumps(make_row("train", args.workload, size, None, options=options,
                              recipe=recipe.to_dict(), **res.to_row(),
                              env=environment(device)), indent=1))
    bad = res.first_nonfinite()
    if bad is not None:  # the row is printed above; the run itself failed
        print(f"fasttrain: error: the loss became {res.losses[bad - 1]} at step {bad} of "
              f"{len(res.losses)}: lower the learning rate or check the data and the loss",
              file=sys.stderr)
        return 1
    return 0


def cmd_profile(args) -> int:
    from .measure.rows import append_row
    from .profile.advisor import Finding, suggest_recipe
    from .profile.runner import run_profile
    from .recipe import to_toml
    from .report.live import default_console
    from .report.profile import render
    from .workloads import load_workload

    device = _device(args.device)
    size = args.size or ("base" if device.startswith("cuda") else "tiny")
    if args.steps < 2 or args.active < 1 or args.warmup < 0:
        raise FasttrainError("profile: --steps must be >= 2, --active >= 1, --warmup >= 0")
    recipe = _base_recipe(args)
    wl = load_workload(args.workload, size, seed=recipe.seed, data=args.data, **_options(args.opt))
    folder = _out_path(args, "profile", size, suffix="")
    snap = folder / "memory-snapshot.pickle" if args.memory_snapshot else None
    row = run_profile(wl, recipe, device, steps=args.steps, warmup=args.warmup,
                      active=args.active, trace_dir=folder, snapshot=snap)
    from .distributed.env import current

    if not current().main:  # every rank profiles; rank 0 reports
        return 0
    append_row(folder / "profile.jsonl", row)
    default_console().print(render(row))
    print(f"row: {folder / 'profile.jsonl'}")
    if args.suggest_recipe:
        findings = [Finding(**f) for f in row["findings"]]
        better = suggest_recipe(recipe, findings)
        note = "\n".join(f"{f.rule}: {f.evidence}" for f in findings) or "no findings"
        Path(args.suggest_recipe).write_text(to_toml(better, comment=f"fasttrain profile "
                                             f"{args.workload} {size}\n{note}"))
        print(f"suggested recipe: {args.suggest_recipe} "
              f"(measure it: fasttrain ladder {args.workload} --recipe {args.suggest_recipe})")
    return 0


def cmd_fit(args) -> int:
    from rich.table import Table

    from .measure.env import environment
    from .fit.search import FitSpec, fit
    from .measure.rows import append_row
    from .report.live import default_console

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


def cmd_scaling(args) -> int:
    from .ladder.scaling import run_scaling
    from .report.live import default_console
    from .workloads import load_workload

    if args.nproc > 1 or args.nnodes > 1:
        raise FasttrainError("scaling sets the process counts itself: use --worlds 1,2,4,8")
    device = _device(args.device)
    size = args.size or ("base" if device.startswith("cuda") else "tiny")
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        raise FasttrainError(f"--worlds expects numbers like 1,2,4,8, got {args.worlds!r}") from None
    if 1 not in worlds or min(worlds) < 1:
        raise FasttrainError("--worlds must include 1 (the single-process reference)")
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


def cmd_report(args) -> int:
    from rich.console import Console

    from .measure.rows import load_rows
    from .report.table import markdown_table, rich_table

    for path in args.rows:
        if not Path(path).is_file():
            raise FasttrainError(f"no such rows file: {path}")
        rows = load_rows(path)
        if args.markdown:
            print(markdown_table(rows, link=path))
        else:
            Console().print(rich_table(rows, title=path))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        if args.command not in ("report", "workloads", "presets"):
            _check_common(args)
            _use_preset(args)
        if args.command in ("train", "profile") and (args.nproc > 1 or args.nnodes > 1):
            from .distributed.env import launched
            from .distributed.launch import relaunch

            if not launched():
                return relaunch(argv, args.nproc, args.nnodes, args.rdzv_endpoint)
        if args.command == "presets":
            return cmd_presets(args)
        if args.command == "workloads":
            from .workloads import REGISTRY
            for name, target in REGISTRY.items():
                print(f"{name:8s} {target}")
            return 0
        return {"ladder": cmd_ladder, "train": cmd_train, "profile": cmd_profile,
                "fit": cmd_fit, "scaling": cmd_scaling, "report": cmd_report}[args.command](args)
    except ValueError as err:  # a workload's or technique's complaint about the input
        print(f"fasttrain: error: {err}", file=sys.stderr)
        return 2
    except FasttrainError as err:
        print(f"fasttrain: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fasttrain: interrupted", file=sys.stderr)
        return 130
    finally:
        from .distributed.env import shutdown

        shutdown()
