"""One rung in a fresh process: ``python -m fasttrain.ladder.child SPEC.json ROW.json``.

A fresh process per rung keeps memory, compile caches and global flags from leaking between
rungs. Whatever happens, a row is written (atomically): an OOM or a crash inside Python is a row
with ``error`` set.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: readers see the old
    file or the whole new one, never a part."""
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)
    os.replace(tmp, path)


def run_spec(spec: dict) -> dict:
    import torch

    from ..errors import FasttrainError, describe_error
    from ..recipe import Recipe
    from ..run.loop import train
    from ..workloads import load_workload

    row: dict = {}
    try:
        wl = load_workload(spec["workload"], spec["size"], seed=spec["recipe"].get("seed", 0),
                           data=spec.get("data"), **spec.get("options", {}))
        recipe = Recipe().replace(**spec["recipe"])
        res = train(wl, recipe, steps=spec["steps"], warmup=spec["warmup"], device=spec["device"])
        row.update(res.to_row())
        row["error"] = None
    except torch.OutOfMemoryError as err:
        row["error"] = "out of memory: " + str(err).splitlines()[0][:200]
    except FasttrainError as err:
        row["error"] = str(err)
    except Exception as err:  # a crashed rung is a row, not an abort of the ladder
        traceback.print_exc()
        row["error"] = describe_error(err, 300)
    return row


def main(argv: list[str]) -> int:
    from ..distributed.env import current, shutdown

    spec = json.loads(Path(argv[0]).read_text())
    row = run_spec(spec)
    d = current()
    if d.main:  # under torchrun every rank runs the rung; rank 0 reports it
        row["world_size"] = d.world
        write_atomic(Path(argv[1]), json.dumps(row))
    shutdown()
    if row.get("error") and not d.main:  # fail the job so torchrun reports this rank's cause
        print(f"rank {d.rank}: {row['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
