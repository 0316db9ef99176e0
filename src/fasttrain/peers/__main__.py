"""``python -m fasttrain.peers WORKLOAD [...]``: run one peer, print its row as JSON."""
from __future__ import annotations

import argparse
import json
import sys

from ..measure.rows import append_row
from . import PEERS, run_peer


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when the row has no error, 1 otherwise (the row is printed either way)."""
    ap = argparse.ArgumentParser(prog="python -m fasttrain.peers", description=__doc__)
    ap.add_argument("workload", help=f"{', '.join(sorted(PEERS))}, or timm:NAME")
    ap.add_argument("--size", default="base")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peer-recipe", default=None,
                    help="fp32 | tf32 | bf16 | bf16+compile (default: the workload's)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="miniature configs of the same classes")
    ap.add_argument("--out", default=None, help="append the row as one JSON line to this file")
    args = ap.parse_args(argv)
    row = run_peer(args.workload, size=args.size, batch=args.batch, steps=args.steps, warmup=args.warmup,
                   peer_recipe=args.peer_recipe, device=args.device, tiny=args.tiny)
    line = json.dumps(row)
    print(line)
    if args.out:
        append_row(args.out, row)  # one fsynced line: rows from parallel runs stay whole
    return 0 if row["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
