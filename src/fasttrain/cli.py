"""Command line: parse, call the library, render. User mistakes are one line, exit status 2;
a run that fails (a ladder rung's error or parity, a failed peer, a ladder whose every rung was
skipped, a train run's non-finite loss, a crash) is one line too and exits 1; Ctrl-C, 130."""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import sys
from pathlib import Path

from .errors import FasttrainError, RunFailed


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


class _Usage(Exception):
    """A command line argparse cannot parse: main prints it on one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a parse error is one line naming the command and where its help is, not
    the usage block (``--help`` still prints it)."""

    def error(self, message: str):
        command = self.prog.removeprefix("fasttrain").strip()  # "train", or "" at the top
        raise _Usage(f"{command + ': ' if command else ''}{message} (see {self.prog} --help)")


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


def _infer_parser(sub) -> None:
    """``fasttrain infer``'s options (docs/inference.md)."""
    inf = sub.add_parser("infer", help="the inference ladder: latency, throughput and "
                         "accuracy against fp32, rung by rung, beside PyTorch's best")
    inf.add_argument("workload", nargs="?", default="vit",
                     help="an image classifier: timm:NAME, vit or swin (default vit)")
    inf.add_argument("--size", default=None, help="tiny | base (default: base on CUDA, tiny "
                     "on CPU)")
    inf.add_argument("--rungs", default="default",
                     help="comma-separated rungs (eager-fp32, eager-fp16, sdpa, compile, graphs, "
                          "kernels, fp8, int8) or default (all); eager-fp32 always runs first")
    inf.add_argument("--batch", type=int, default=64, help="the throughput batch (default 64)")
    inf.add_argument("--images", type=int, default=1024,
                     help="held-out images the accuracy is measured on (default 1024)")
    inf.add_argument("--iters", type=int, default=50, help="timed calls (default 50)")
    inf.add_argument("--warmup", type=int, default=10, help="untimed calls (default 10)")
    inf.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    inf.add_argument("--data", default=None,
                     help="a labelled image folder (one subfolder per class) to evaluate on")
    inf.add_argument("--opt", action="append", metavar="KEY=VALUE", help="workload option")
    inf.add_argument("--checkpoint", default=None, metavar="DIR",
                     help="a fasttrain train --save folder: serve its weights")
    inf.add_argument("--no-peer", dest="peer", action="store_false",
                     help="leave out the PyTorch peers (eager fp16, compile reduce-overhead)")
    inf.add_argument("--export", default=None, metavar="FILE.pt2",
                     help="export the fastest rung that passes as an AOTInductor package")
    inf.add_argument("--out", default="out", help="folder for the JSONL rows (default out/)")
    inf.add_argument("--rung-timeout", type=float, default=900.0, help="seconds per rung")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fasttrain", description=__doc__)
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
    lad.add_argument("--long", type=int, default=0, metavar="STEPS",
                     help="long-run parity: the bf16-mixed baseline and each numerics switch "
                          "(fp8, bf16-stream, bf16-weights; pick with --rungs) run STEPS steps "
                          "each, their loss curves compared (2,000 make the point)")
    lad.add_argument("--tensorboard", default=None, metavar="DIR",
                     help="also write each rung's per-step loss, lr, step time and throughput "
                          "as a TensorBoard run under DIR")
    tr = sub.add_parser("train", help="one measured run of a recipe; prints a summary, writes "
                        "its row")
    _common(tr)
    tr.add_argument("--out", default="out", help="folder for the JSONL row (default out/)")
    tr.add_argument("--tensorboard", default=None, metavar="DIR",
                    help="also write the per-step loss, lr, step time and throughput as a "
                         "TensorBoard run under DIR")
    tr.add_argument("--json", action="store_true",
                    help="print the row as JSON on stdout instead of the summary (for scripts)")
    tr.add_argument("--save", default=None, metavar="DIR",
                    help="write a DCP checkpoint after, as a new step folder DIR/step-NNNNNN")
    tr.add_argument("--save-every", type=int, default=0, metavar="N",
                    help="with --save: also save every N steps (SIGINT/SIGTERM save and stop)")
    tr.add_argument("--keep", type=int, default=2, metavar="K",
                    help="with --save: keep the newest K step folders (default 2)")
    tr.add_argument("--resume", default=None, metavar="DIR",
                    help="continue a DCP checkpoint (a --save DIR: its newest complete save); "
                         "auto: the newest save of --save DIR where there is one, else start")
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
    _infer_parser(sub)
    rep = sub.add_parser("report", help="render result rows (JSONL) as a table or an HTML page")
    rep.add_argument("rows", nargs="+")
    how = rep.add_mutually_exclusive_group()
    how.add_argument("--markdown", action="store_true")
    how.add_argument("--html", metavar="FILE", default=None,
                     help="write one self-contained HTML page (charts and tables) of all the rows")
    sub.add_parser("workloads", help="list the registered workloads")
    sub.add_parser("presets", help="list the shipped presets and their measured speed-ups")
    docs = sub.add_parser("docs", help="write the generated pages docs/recipe.md and "
                          "docs/results.md (run from the repository root)")
    docs.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 naming the pages that are not current")
    return parser


def _out_path(args, kind: str, size: str, suffix: str = ".jsonl") -> Path:
    """``out/<kind>-<workload>-<size>-<time><suffix>`` (a module:factory made file-safe), made
    here (a folder where ``suffix`` is empty) so that no other command gets it: a second one
    started in the same second with the same --out gets ``-2``, ``-3``… before the suffix.
    Left empty, it is removed when the command ends (:func:`_drop_unused_outputs`)."""
    _out_folder(args.out)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = args.workload.replace(":", "_").replace(".", "_")
    for n in range(1, 10_000):
        path = Path(args.out) / f"{kind}-{name}-{size}-{stamp}{f'-{n}' if n > 1 else ''}{suffix}"
        if os.environ.get("RANK", "0") != "0":  # a torchrun rank other than 0 writes no rows
            return path
        try:
            if suffix:
                open(path, "x").close()
            else:
                path.mkdir()
        except FileExistsError:
            continue
        _OUTPUTS.append(path)
        return path
    raise FasttrainError(f"--out {args.out}: 10,000 {kind} files of this second already: give "
                         "another folder")


_OUTPUTS: list[Path] = []
"""The files and folders :func:`_out_path` made for the command under way."""


def _drop_unused_outputs() -> None:
    """Remove what :func:`_out_path` made and nothing filled (a run refused or stopped before
    its first row)."""
    while _OUTPUTS:
        path = _OUTPUTS.pop()
        try:
            if path.is_dir():
                path.rmdir()  # only an empty one
            elif path.stat().st_size == 0:
                path.unlink()
        except OSError:  # a folder with files, or gone already
            pass


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


def _file_target(path: str, flag: str) -> None:
    """A file a command writes after its run (``--export``, ``--suggest-recipe``) is checked
    before it: not a folder, in a folder that exists and this user can write."""
    p = Path(path)
    if p.is_dir():
        raise FasttrainError(f"{flag} {path} is a folder: give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise FasttrainError(f"{flag} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FasttrainError(f"{flag} {path}: the folder {parent} is not writable")


def _base_recipe(args):
    from .recipe import Recipe, load_toml, parse_sets

    base = load_toml(args.recipe) if args.recipe else Recipe()
    sets = parse_sets(args.set)
    if args.batch is not None:
        sets["batch"] = str(args.batch)
    return base.replace(**sets) if sets else base


def cmd_ladder(args) -> int:
    from .ladder.runner import LadderSpec, failures, run_ladder
    from .report.live import show_progress
    from .report.table import ratio_warning

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
    try:
        rows = show_progress(lambda on_row, on_start: run_ladder(spec, on_row, on_start),
                             f"fasttrain ladder · {spec.workload} {spec.size} · {spec.device}")
    except KeyboardInterrupt:  # the rows finished so far are already in the file
        kept = (f"the rows finished so far are in {out}" if out.exists() and out.stat().st_size
                else "no row finished")
        print(f"fasttrain: interrupted: {kept}", file=sys.stderr)
        return 130
    if rungs == ["fast"]:
        from .ladder.search import write_fast_preset

        print(write_fast_preset(args.workload, size, rows, out))
    if ratio_warning(rows):
        print(f"warning: {ratio_warning(rows)}")
    if args.tensorboard:
        from .report.tensorboard import write_scalars

        runs = write_scalars(rows, Path(args.tensorboard) / out.stem)
        print(f"tensorboard: {len(runs)} runs in {Path(args.tensorboard) / out.stem}")
    print(f"rows: {out}")
    failed = failures(rows)
    return _error(f"the ladder failed: {failed}", 1) if failed else 0


def _resume_from(args) -> str | None:
    """--resume DIR as given; ``auto``: the newest complete save of --save DIR, or none (a
    first start, or a first save that was cut off), said on one line."""
    if args.resume != "auto":
        return args.resume
    if not args.save:
        raise FasttrainError("--resume auto continues the newest save of --save DIR; give --save")
    from .distributed.env import launched
    from .run.checkpoint import latest

    found = latest(args.save)
    if os.environ.get("RANK", "0") == "0" or not launched():
        print(f"resume: {'continuing ' + str(found) if found else 'no complete save in '}"
              f"{'' if found else args.save + ' yet: starting from step 0'}", file=sys.stderr)
    return str(found) if found else None


def _long(args, device: str, size: str, rungs: list[str]) -> int:
    """``ladder --long N``: the numerics switches' loss curves against bf16-mixed's."""
    from .ladder.long_run import failures, long_plan, long_table, run_long
    from .ladder.spec import LadderSpec
    from .measure.curves import WINDOWS

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


def cmd_train(args) -> int:
    from .run.loop import train
    from .workloads import load_workload

    device = _device(args.device)
    size = args.size or ("base" if device.startswith("cuda") else "tiny")
    recipe = _base_recipe(args)
    if args.export and not args.save:
        raise FasttrainError("--export consolidates the checkpoint of --save; give both")
    if args.save_every and not args.save:
        raise FasttrainError("--save-every saves into the folder of --save; give both")
    if args.save_every < 0 or args.keep < 1:
        raise FasttrainError(f"--save-every must be 0 or more and --keep 1 or more, not "
                             f"{args.save_every} and {args.keep}")
    if args.export:
        _file_target(args.export, "--export")
    resume = _resume_from(args)
    out = _out_path(args, "train", size)  # a wrong --out is refused before the run
    options = _options(args.opt)
    wl = load_workload(args.workload, size, seed=recipe.seed, data=args.data, **options)
    from .distributed.env import current
    from .run.saving import Stopped

    try:
        res = train(wl, recipe, steps=args.steps, warmup=args.warmup, device=device,
                    save_to=args.save, resume_from=resume, save_every=args.save_every,
                    keep=args.keep)
    except Stopped as stop:  # SIGINT/SIGTERM: saved after the step under way
        if current().main:
            print(stop, file=sys.stderr)
        return stop.exit_code
    if not current().main:
        return 0
    if args.export:
        from .run.checkpoint import export

        export(args.save, args.export)
    from .measure.env import environment
    from .measure.rows import append_row, make_row

    name = args.preset or (Path(args.recipe).stem if args.recipe else "default")
    row = make_row("train", args.workload, size, None, options=options, device=device,
                   recipe_name=name, recipe=recipe.to_dict(), **res.to_row(),
                   env=environment(device))
    append_row(out, row)
    if args.tensorboard:
        from .report.tensorboard import write_scalars

        write_scalars([{**row, "rung": out.stem}], args.tensorboard)
    if args.json:
        print(json.dumps(row, indent=1))
    else:
        from .recipe import Recipe
        from .report.live import default_console
        from .report.train import train_summary

        default_console().print(train_summary(row, str(out), Recipe().to_dict()))
    bad = res.failed_step()  # fp16: a step the GradScaler skipped and recovered from passes
    if bad is not None:  # the row is written above; the run itself failed
        return _error(f"the loss became {res.losses[bad - 1]} at step {bad} of "
                      f"{len(res.losses)}: lower the learning rate or check the data and the "
                      "loss", 1)
    return 0


def cmd_profile(args) -> int:
    from .measure.files import write_atomic
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
    if args.suggest_recipe:
        _file_target(args.suggest_recipe, "--suggest-recipe")
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
        write_atomic(args.suggest_recipe, to_toml(better, comment=f"fasttrain profile "
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


def cmd_infer(args) -> int:
    from .inference.runner import InferLadder
    from .report.live import default_console

    device = _device(args.device)
    size = args.size or ("base" if device.startswith("cuda") else "tiny")
    if args.rung_timeout is not None and args.rung_timeout <= 0:
        raise FasttrainError("--rung-timeout must be > 0 seconds")
    if args.export and not args.export.endswith(".pt2"):
        raise FasttrainError(f"--export {args.export}: an AOTInductor package is a .pt2 file")
    if args.export and not Path(args.export).resolve().parent.is_dir():
        raise FasttrainError(f"--export {args.export}: no folder {Path(args.export).parent}")
    if args.export and Path(args.export).is_dir():
        raise FasttrainError(f"--export {args.export} is a folder: give a file name")
    rungs = [r.strip() for r in args.rungs.split(",") if r.strip()]
    if not rungs:
        raise FasttrainError("--rungs names no rung (give default for all)")
    out = _out_path(args, "infer", size)
    spec = InferLadder(workload=args.workload, size=size, rungs=rungs, device=device,
        batch=args.batch, images=args.images, iters=args.iters, warmup=args.warmup,
        data=args.data, options=_options(args.opt), checkpoint=args.checkpoint, peer=args.peer,
        out=out, timeout=args.rung_timeout)
    from .inference.runner import check

    check(spec)  # a refusal before anything is printed or started
    console = default_console()
    console.print(f"fasttrain infer · {spec.workload} {size} · {device} · batch {spec.batch}, "
                  f"{spec.images} held-out images")
    from .run.scratch import scratch

    with scratch("infer") as workdir:
        return _infer_in(spec, args, workdir, console)


def _infer_in(spec, args, workdir: Path, console) -> int:
    """``cmd_infer`` with the run's folder (the shared held-out images and fp32 logits)."""
    from .inference.runner import failed, run_infer
    from .report.inference import inference_table, line, notes

    device, size = spec.device, spec.size
    rows = run_infer(spec, lambda row, i, n: print(f"[{i + 1}/{n}] {line(row)}", flush=True),
                     workdir)
    console.print(inference_table(rows, title=f"inference · {spec.workload} {size} · {device}",
                                  width=console.width))
    for text in notes(rows):
        console.print(text)
    if device == "cpu":
        console.print("CPU timings check plumbing and accuracy; they are not speed-ups worth "
                      "quoting.")
    if args.export:
        from .inference.export import export_best

        row = export_best(spec, rows, Path(args.export), workdir)
        console.print(line(row) if not row.get("error") else f"export: {row['error']}")
        rows.append(row)
    print(f"rows: {spec.out}")
    return 1 if failed(rows) else 0


def cmd_docs(args) -> int:
    """Write the generated docs pages, or with --check say which are stale (exit 1)."""
    from .report.docs import stale, write

    if args.check:
        old = stale()
        if old:
            return _error(f"docs: {', '.join(map(str, old))} not current: run `fasttrain docs` "
                          "from the repository root", 1)
        print("docs: current")
        return 0
    changed = write()
    print(f"docs: wrote {', '.join(map(str, changed))}" if changed else "docs: current")
    return 0


def cmd_report(args) -> int:
    from rich.console import Console

    from .measure.rows import read_rows
    from .report.table import ladder_view, markdown_table

    if args.html:
        from .report.html import write_html

        files = {path: read_rows(path) for path in args.rows}
        print(f"report: {write_html(files, args.html)}")
        return 0
    for path in args.rows:
        rows = read_rows(path)  # a missing, empty or non-JSON file: one line, exit 2
        console = Console()
        if rows and all(r.get("kind") == "inference" for r in rows) and not args.markdown:
            from .report.inference import inference_table, notes

            console.print(inference_table(rows, title=path, width=console.width))
            for text in notes(rows):
                console.print(text)
        elif rows and all(r.get("kind") == "long" for r in rows) and not args.markdown:
            from .ladder.long_run import long_table

            print(path)
            print("\n".join(long_table(rows)))
        elif args.markdown:
            print(markdown_table(rows, link=path))
        else:
            console.print(ladder_view(rows, title=path, width=console.width))
    return 0


def _error(message: object, code: int) -> int:
    """The one line of an error on stderr (a message's own line breaks folded); ``code``."""
    text = " ".join(str(message).split("\n")).strip()
    print(f"fasttrain: error: {text}", file=sys.stderr)
    return code


def _run_failed(err: Exception) -> int:
    """A run that crashed (not a mistake in the command): one line, exit status 1; with
    FASTTRAIN_TRACEBACK=1 the traceback first, for a bug report. A full disk met outside
    fasttrain's own writers (a checkpoint shard) is said as such, naming the file."""
    from .errors import describe_error, disk_full

    if (full := disk_full(err)) is not None:
        return _error(full, 1)
    if os.environ.get("FASTTRAIN_TRACEBACK") == "1":
        import traceback

        traceback.print_exception(err)
        return _error(f"the run failed: {describe_error(err)}", 1)
    return _error(f"the run failed: {describe_error(err)} (FASTTRAIN_TRACEBACK=1 shows where)", 1)


class _Terminated(BaseException):
    """SIGTERM, raised where the command is so that its folders and children are cleaned up."""


def _on_sigterm(signum, frame) -> None:
    raise _Terminated()


def _end_with_parent() -> None:
    """A rank torchrun started ends when torchrun does (a SIGKILL leaves nothing behind)."""
    from .distributed.env import launched
    from .distributed.launch import die_with_parent

    if launched():
        die_with_parent()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _end_with_parent()
    import signal
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return _main(argv)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except _Usage as err:
        return _error(err, 2)
    try:
        if args.command not in ("report", "workloads", "presets", "infer", "docs"):
            _check_common(args)
            _use_preset(args)
        if args.command in ("train", "profile") and (args.nproc > 1 or args.nnodes > 1):
            from .distributed.env import launched
            from .distributed.launch import relaunch

            if not launched():
                return relaunch(argv, args.nproc, args.nnodes, args.rdzv_endpoint)
        if args.command == "presets":
            return cmd_presets(args)
        if args.command == "docs":
            return cmd_docs(args)
        if args.command == "workloads":
            from .workloads import REGISTRY
            for name, target in REGISTRY.items():
                print(f"{name:8s} {target}")
            return 0
        return {"ladder": cmd_ladder, "train": cmd_train, "profile": cmd_profile,
                "fit": cmd_fit, "scaling": cmd_scaling, "report": cmd_report,
                "infer": cmd_infer}[args.command](args)
    except RunFailed as err:  # the run, not the command, went wrong: said in one line
        code = _error(err, 1)
        from .distributed.env import launched

        if launched():  # a peer hung: tearing the process group down would wait for it
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    except (ValueError, FasttrainError) as err:  # a complaint about the input
        return _error(err, 2)
    except KeyboardInterrupt:
        print("fasttrain: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("fasttrain: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except Exception as err:  # noqa: BLE001 - the contract: a failed run is one line, exit 1
        return _run_failed(err)
    finally:
        _drop_unused_outputs()
        from .distributed.env import shutdown

        shutdown()
