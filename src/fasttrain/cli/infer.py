"""``fasttrain infer``: the inference ladder, rung by rung, beside PyTorch's best."""
from __future__ import annotations

from pathlib import Path

from ..errors import FasttrainError
from .common import _device, _options, _out_path


def cmd_infer(args) -> int:
    from ..inference.runner import InferLadder
    from ..report.live import default_console

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
    from ..inference.runner import check

    check(spec)  # a refusal before anything is printed or started
    console = default_console()
    console.print(f"fasttrain infer · {spec.workload} {size} · {device} · batch {spec.batch}, "
                  f"{spec.images} held-out images")
    from ..run.scratch import scratch

    with scratch("infer") as workdir:
        return _infer_in(spec, args, workdir, console)


def _infer_in(spec, args, workdir: Path, console) -> int:
    """``cmd_infer`` with the run's folder (the shared held-out images and fp32 logits)."""
    from ..inference.runner import failed, run_infer
    from ..report.inference import inference_table, line, notes

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
        from ..inference.export import export_best

        row = export_best(spec, rows, Path(args.export), workdir)
        console.print(line(row) if not row.get("error") else f"export: {row['error']}")
        rows.append(row)
    print(f"rows: {spec.out}")
    return 1 if failed(rows) else 0
