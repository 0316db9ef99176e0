"""One job in a fresh process: a typed spec in, a row out.

``run_in_child(spec, ...)`` writes the spec to a file, starts ``python -m fasttrain.run.child
SPEC.json ROW.json`` (under torchrun when ``nproc`` > 1), waits, and returns the row the child
wrote. The child imports the job named by ``spec.job`` (``"package.module:function"``, a function
taking the :class:`ChildSpec` and returning a row dict), runs it and writes its row atomically.

A fresh process per measurement keeps memory, compile caches and global flags from leaking
between rungs, trials and peers. Whatever happens, there is a row: an OOM, a user's error or a
crash inside Python is a row with ``error`` set; a child that dies, hangs past its timeout or
exits non-zero leaves its reason in ``error`` too. The ladder's rungs (:func:`train_job`), the
fit search's trials (``fasttrain.fit.trial``) and the peers (``fasttrain.peers``) all run this
way.
"""
from __future__ import annotations

import importlib
import json
import signal
import subprocess
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..distributed.launch import child_env, die_with_parent, torchrun_prefix
from ..errors import FasttrainError, describe_error
from ..measure.files import write_atomic


@dataclass(frozen=True)
class ChildSpec:
    """What to run in the fresh process, and on what."""

    job: str
    """The function to call, ``"package.module:function"``: takes this spec, returns a row."""
    workload: str
    """A registry name (``vit``), ``package.module:factory``, or a public model name."""
    size: str = "tiny"
    device: str = "cpu"
    recipe: dict[str, Any] = field(default_factory=dict)
    """``Recipe.to_dict()`` of the recipe to run (a peer's job reads ``peer_recipe`` here)."""
    steps: int = 20
    """Timed steps."""
    warmup: int = 5
    """Steps before the timed ones (compile, capture, allocator warm-up)."""
    data: str | None = None
    """A folder of the user's data instead of the workload's synthetic set."""
    options: dict[str, Any] = field(default_factory=dict)
    """Workload options (``--opt key=value``)."""
    batch: int | None = None
    """The global batch where the recipe does not carry it (a peer)."""
    budget_gib: float | None = None
    """A memory budget the job enforces (a fit trial)."""
    job_args: dict[str, Any] = field(default_factory=dict)
    """Whatever else the job needs, as JSON (an inference rung's spec)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ChildSpec":
        return cls(**json.loads(text))


def _resolve(job: str) -> Callable[[ChildSpec], dict]:
    module, _, name = job.partition(":")
    if not name:
        raise FasttrainError(f"job {job!r} is not of the form package.module:function")
    return getattr(importlib.import_module(module), name)


def run_job(spec: ChildSpec) -> dict:
    """Run ``spec.job`` here; every failure comes back as the row's ``error``."""
    import torch

    try:
        row = dict(_resolve(spec.job)(spec))
        row.setdefault("error", None)
    except torch.OutOfMemoryError as err:
        row = {"error": "out of memory: " + str(err).splitlines()[0][:200]}
    except FasttrainError as err:
        row = {"error": str(err)}
    except Exception as err:  # a crashed job is a row, not an abort of the ladder
        traceback.print_exc()
        row = {"error": describe_error(err, 300)}
    return row


def main(argv: list[str]) -> int:
    from ..distributed.env import current, launched, shutdown

    if launched():  # a rank: ends with torchrun (which ends with the ladder that started it)
        die_with_parent()
    # SIGTERM (the ladder ending, torchrun stopping the ranks) unwinds: temporary folders go
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    spec = ChildSpec.from_json(Path(argv[0]).read_text())
    row = run_job(spec)
    d = current()
    if d.main:  # under torchrun every rank runs the job; rank 0 reports it
        write_atomic(Path(argv[1]), json.dumps(row))
    shutdown()
    if row.get("error") and not d.main:  # fail the job so torchrun reports this rank's cause
        print(f"rank {d.rank}: {row['error']}", file=sys.stderr)
        return 1
    return 0


def _wait(args: list[str], timeout: float | None, log: Path,
          extra_env: dict[str, str] | None, nproc: int) -> str | None:
    """Run ``python -m fasttrain.run.child args`` (under torchrun when ``nproc`` > 1); an error
    line, or None when it exited 0."""
    env = child_env(extra_env, nproc)
    prefix = torchrun_prefix(nproc) if nproc > 1 else [sys.executable]
    with open(log, "w") as logf:
        proc = subprocess.Popen([*prefix, "-m", __name__, *args], stdout=logf,
                                stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end(proc)
            return f"timed out after {timeout:.0f} s"
        except BaseException:  # Ctrl-C, SIGTERM: the rung under way ends with us
            _end(proc)
            raise
    if proc.returncode != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        return f"process exited with {proc.returncode}: {tail[0][:200] if tail else ''}"
    return None


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM (torchrun forwards it to its workers and waits for them), SIGKILL after 60 s."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_in_child(spec: ChildSpec, workdir: Path, name: str, timeout: float | None = None,
                 extra_env: dict[str, str] | None = None, nproc: int = 1) -> dict:
    """Run ``spec`` in a fresh process (``nproc`` of them under torchrun); its row. Files go
    to ``workdir`` as ``NAME.spec.json``, ``NAME.row.json`` and ``NAME.log``."""
    spec_path, row_path = workdir / f"{name}.spec.json", workdir / f"{name}.row.json"
    write_atomic(spec_path, spec.to_json())
    row_path.unlink(missing_ok=True)
    err = _wait([str(spec_path), str(row_path)], timeout, workdir / f"{name}.log", extra_env,
                nproc)
    row = json.loads(row_path.read_text()) if row_path.exists() else {}
    if err and not row.get("error"):
        row["error"] = err
    return row


def train_job(spec: ChildSpec) -> dict:
    """A measured training run (a ladder rung, a scaling point): ``run.loop.train``'s row."""
    from ..recipe import Recipe
    from ..workloads import load_workload
    from .loop import train

    wl = load_workload(spec.workload, spec.size, seed=spec.recipe.get("seed", 0), data=spec.data,
                       **spec.options)
    recipe = Recipe().replace(**spec.recipe)
    row = train(wl, recipe, steps=spec.steps, warmup=spec.warmup, device=spec.device).to_row()
    from ..distributed.env import current

    return {**row, "world_size": current().world}


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
