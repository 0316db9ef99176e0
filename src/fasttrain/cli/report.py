"""The commands that run nothing: ``report`` (rows as a table or a page), ``docs`` (the
generated pages), ``presets`` and ``workloads`` (what ships)."""
from __future__ import annotations

from .common import _error


def cmd_report(args) -> int:
    from rich.console import Console

    from ..measure.rows import read_rows
    from ..report.table import ladder_view, markdown_table

    if args.html:
        from ..report.html import write_html

        files = {path: read_rows(path) for path in args.rows}
        print(f"report: {write_html(files, args.html)}")
        return 0
    for path in args.rows:
        rows = read_rows(path)  # a missing, empty or non-JSON file: one line, exit 2
        console = Console()
        if rows and all(r.get("kind") == "inference" for r in rows) and not args.markdown:
            from ..report.inference import inference_table, notes

            console.print(inference_table(rows, title=path, width=console.width))
            for text in notes(rows):
                console.print(text)
        elif rows and all(r.get("kind") == "long" for r in rows) and not args.markdown:
            from ..ladder.long_run import long_table

            print(path)
            print("\n".join(long_table(rows)))
        elif args.markdown:
            print(markdown_table(rows, link=path))
        else:
            console.print(ladder_view(rows, title=path, width=console.width))
    return 0


def cmd_docs(args) -> int:
    """Write the generated docs pages, or with --check say which are stale (exit 1)."""
    from ..report.docs import stale, write

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


def cmd_presets(args) -> int:
    from ..presets import presets

    print(f"{'preset':20s} {'workload':34s} {'size':5s} {'GPU':5s} {'x peer':>7s}  rows")
    for p in presets().values():
        ratio = f"{p.ratio:.3f}x" if p.ratio is not None else "–"
        print(f"{p.name:20s} {p.workload:34s} {p.size:5s} {p.gpu:5s} {ratio:>7s}  {p.rows}")
    print("x peer: against PyTorch best practice (bf16 + fused AdamW + torch.compile) on the "
          "public model code, in one run; – not confirmed")
    return 0


def cmd_workloads(args) -> int:
    from ..workloads import REGISTRY

    for name, target in REGISTRY.items():
        print(f"{name:18s} {target}")
    for name, what in PUBLIC_EXAMPLES.items():
        print(f"{name:18s} {what}")
    print(f"{'package.module:factory':18s} your own model (docs/your-model.md)")
    return 0


PUBLIC_EXAMPLES = {"timm:NAME": "a timm model by name, e.g. timm:swin_base_patch4_window7_224",
                   "hf:llama": "transformers' LlamaForCausalLM (Llama-3.2-1B shapes, or "
                               "--opt config=CONFIG.json)",
                   "diffusers:sd-v1": "diffusers' SD v1 UNet + CLIP text encoder + VAE encoder"}
