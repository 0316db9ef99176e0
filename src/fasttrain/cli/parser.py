"""Command line: parse, call the library, render. User mistakes are one line, exit status 2;
a run that fails (a ladder rung's error or parity, a failed peer, a ladder whose every rung was
skipped, a train run's non-finite loss, a crash) is one line too and exits 1; Ctrl-C, 130."""
# The docstring above is the text of ``fasttrain --help`` (build_parser's description).
from __future__ import annotations

import argparse


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
                   help="vit | swin | sd | llama | timm:NAME | hf:llama | diffusers:sd-v1 | "
                        "package.module:factory (default vit)")
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


def _ladder_parser(sub) -> None:
    """``fasttrain ladder``'s options."""
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


def _train_parser(sub) -> None:
    """``fasttrain train``'s options."""
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


def _profile_parser(sub) -> None:
    """``fasttrain profile``'s options."""
    pro = sub.add_parser("profile", help="where a step's time and memory go; what to switch on")
    _common(pro)
    pro.set_defaults(steps=10)
    pro.add_argument("--active", type=int, default=3, help="steps under torch.profiler")
    pro.add_argument("--out", default="out", help="folder for the row and the trace")
    pro.add_argument("--memory-snapshot", action="store_true",
                     help="record a memory-history snapshot (CUDA; pytorch.org/memory_viz)")
    pro.add_argument("--suggest-recipe", default=None, metavar="FILE.toml",
                     help="write the advice as a recipe that `fasttrain ladder --recipe` measures")


def _fit_parser(sub) -> None:
    """``fasttrain fit``'s options."""
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


def _scaling_parser(sub) -> None:
    """``fasttrain scaling``'s options."""
    sc = sub.add_parser("scaling", help="per-GPU throughput and memory at 1/2/4/8 processes")
    _common(sc)
    sc.add_argument("--worlds", default="1,2", help="process counts, e.g. 1,2,4,8")
    sc.add_argument("--sharding", default="ddp,zero2,zero3", help="modes for world > 1")
    sc.add_argument("--per-gpu-batch", type=int, default=None)
    sc.add_argument("--out", default="out")
    sc.add_argument("--rung-timeout", type=float, default=None)


def _infer_parser(sub) -> None:
    """``fasttrain infer``'s options (docs/inference.md)."""
    inf = sub.add_parser("infer", help="the inference ladder: latency, throughput and "
                         "accuracy against fp32, rung by rung, beside PyTorch's best")
    inf.add_argument("workload", nargs="?", default="vit",
                     help="an image classifier: timm:NAME, vit, swin or your own module:function "
                          "workload of unit img (default vit)")
    inf.add_argument("--size", default=None, help="tiny | base (default: base on CUDA, tiny "
                     "on CPU)")
    from ..inference.spec import RUNGS  # names only: no torch

    inf.add_argument("--rungs", default="default",
                     help=f"comma-separated rungs ({', '.join(RUNGS)}) or default (all); "
                          "eager-fp32 always runs first")
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


def _listing_parsers(sub) -> None:
    """``fasttrain report``, ``workloads``, ``presets`` and ``docs``: the commands that run
    nothing."""
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


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(prog="fasttrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fasttrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _ladder_parser(sub)
    _train_parser(sub)
    _profile_parser(sub)
    _fit_parser(sub)
    _scaling_parser(sub)
    _infer_parser(sub)
    _listing_parsers(sub)
    return parser
