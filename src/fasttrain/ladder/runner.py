"""Run a ladder: each rung in its own process, rows appended as they finish, parity vs fp32."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from ..env import environment
from ..errors import FasttrainError
from ..recipe import Recipe
from ..run.parity import compare
from ..run.steadiness import confirmed_ratio, needs_another
from ..techniques import allocator, unmet_requirements
from ..workloads import load_workload
from .rungs import FastSearch, Rung, build_ladder


@dataclass
class LadderSpec:
    """What to run: the workload, which rungs, how long, where the rows go."""

    workload: str = "vit"
    size: str = "tiny"
    rungs: list[str] | None = None
    base: Recipe = field(default_factory=Recipe)
    steps: int = 20
    warmup: int = 5
    device: str = "cpu"
    data: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    out: Path | None = None
    peer: bool = False
    rung_timeout: float | None = None
    extra_rungs: list[tuple[str, Recipe]] = field(default_factory=list)
    nproc: int = 1  # processes per rung, launched through torchrun
    start_at: str | None = None  # run the first rung (the parity base), then from this rung on
    confirm: bool = True  # with the peer: measure both sides again (A B B A), _Confirmation


def append_row(path: Path, row: dict) -> None:
    """One JSON line, flushed and fsynced: a crash later never loses a finished row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _run_child(module: str, args: list[str], timeout: float | None, log: Path,
               extra_env: dict[str, str] | None = None, nproc: int = 1) -> str | None:
    """Run ``python -m module args`` (under torchrun when ``nproc`` > 1); an error line or None."""
    from ..distributed.launch import child_env, torchrun_prefix

    env = child_env(extra_env, nproc)
    prefix = torchrun_prefix(nproc) if nproc > 1 else [sys.executable]
    with open(log, "w") as logf:
        proc = subprocess.Popen([*prefix, "-m", module, *args], stdout=logf,
                                stderr=subprocess.STDOUT, env=env)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun forwards SIGTERM to its workers and waits for them
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        return f"process exited with {proc.returncode}: {tail[0][:200] if tail else ''}"
    return None


def run_rung(spec: LadderSpec, name: str, recipe: Recipe, workdir: Path) -> dict:
    child = {"workload": spec.workload, "size": spec.size, "data": spec.data,
             "options": spec.options, "recipe": recipe.to_dict(), "steps": spec.steps,
             "warmup": spec.warmup, "device": spec.device}
    spec_path, row_path = workdir / f"{name}.spec.json", workdir / f"{name}.row.json"
    spec_path.write_text(json.dumps(child))
    err = _run_child("fasttrain.ladder.child", [str(spec_path), str(row_path)],
                     spec.rung_timeout, workdir / f"{name}.log", allocator.child_env(recipe),
                     nproc=spec.nproc)
    row = json.loads(row_path.read_text()) if row_path.exists() else {}
    if err and not row.get("error"):
        row["error"] = err
    return row


def finish_row(row: dict, ref: dict | None, precision: str) -> dict:
    """Parity against the reference rung; TFLOP/s from the reference's FLOP count."""
    if row.get("error") or row.get("skipped") or not ref or ref.get("error"):
        return row
    row["parity"] = compare(row["losses"], ref["losses"], precision)
    if ref.get("model_flops"):
        flops = ref["model_flops"] * row["batch"] / ref["batch"]
        row["probe_flops"], row["model_flops"] = row.get("model_flops"), flops
        row["tflops"] = flops / row["step_time_s"] / 1e12
        if row.get("mfu") is not None and row.get("probe_flops"):
            row["mfu"] = row["mfu"] * flops / row["probe_flops"]
    row["speedup"] = ref["step_time_s"] / row["step_time_s"] * row["batch"] / ref["batch"]
    return row


def _check(row: dict, rung: Rung, ref: dict | None, prev: dict | None, recipe: Recipe) -> dict:
    """Parity against the rung's reference (the first rung, or the previous one where the rung
    after a deliberate change of the maths is math-equivalent to its predecessor)."""
    if row is ref:
        return finish_row(row, ref, "fp32")
    if rung.parity == "none":
        row = finish_row(row, ref, recipe.precision)
        if not row.get("error") and not row.get("skipped"):
            row["parity"] = {"max_rel_dev": None, "tolerance": None, "passed": None,
                             "reason": f"not checked: {rung.parity_note}"}
        return row
    row = finish_row(row, ref, recipe.precision)
    if rung.parity == "previous" and prev is None and row.get("parity"):
        row["parity"] = {"max_rel_dev": None, "tolerance": None, "passed": None,
                         "reason": "not checked: the rung before it did not run"}
        return row
    against = prev if rung.parity == "previous" else ref
    if against is not ref and row.get("parity"):
        row["parity"] = {**compare(row["losses"], against["losses"], recipe.precision),
                         "against": against["rung"]}
    return row


def _plan(spec: LadderSpec):
    wl = load_workload(spec.workload, spec.size, seed=spec.base.seed, data=spec.data,
                       **spec.options)
    plan = [(r, rec) for r, rec in build_ladder(wl, spec.rungs, spec.base)]
    if spec.start_at:
        names = [r.name for r, _ in plan]
        if spec.start_at not in names:
            raise FasttrainError(f"--from {spec.start_at!r} is not a rung of this ladder: use "
                                 f"{', '.join(names)}")
        i = names.index(spec.start_at)
        if i > 1:  # recipes stay cumulative; the skipped rungs just do not run
            first, rec = plan[i]
            if first.parity == "previous":
                first = replace(first, parity="none", parity_note="the rung before it did "
                                "not run (--from)")
            plan = [plan[0], (first, rec), *plan[i + 1:]]
    plan += [(Rung(name, {}, "user recipe"), rec) for name, rec in spec.extra_rungs]
    search = FastSearch(wl, spec.base, spec.nproc) if spec.rungs == ["fast"] else None
    graphs = any(rec.cuda_graphs for _, rec in plan) or (
        search is not None and any(key == "cuda_graphs" for _, key, _ in search.axes))
    if spec.device.startswith("cuda") and graphs:
        spec.warmup = max(spec.warmup, 4)  # 3 eager steps + capture; same for every rung
    return wl, plan, search


def run_ladder(spec: LadderSpec, on_row: Callable[[dict, int, int], None] | None = None,
               on_start: Callable[[str, int, int], None] | None = None) -> list[dict]:
    """Run every rung (and the peer); returns the rows, also appended to ``spec.out``."""
    wl, plan, search = _plan(spec)
    env = environment(spec.device)
    rows, ref, prev = [], None, None
    # the search adds one rung per switch; the peer one, the confirmation three more (five
    # with tie-breakers, which the count leaves out)
    total = len(plan) + (len(search.axes) if search else 0) + (
        (4 if spec.confirm else 1) if spec.peer else 0)
    with tempfile.TemporaryDirectory(prefix="fasttrain-ladder-") as tmp:
        workdir = Path(tmp)
        i = -1
        while i + 1 < len(plan):
            i += 1
            rung, recipe = plan[i]
            if on_start:
                on_start(rung.name, i, total)
            base = {"kind": "ladder", "workload": spec.workload, "size": spec.size,
                    "rung": rung.name, "comment": rung.comment, "recipe": recipe.to_dict(),
                    "parity": None}
            unmet = unmet_requirements(recipe, spec.device.split(":")[0])
            t0 = time.perf_counter()
            row = {"skipped": "; ".join(unmet), "error": None} if unmet else run_rung(
                spec, rung.name, recipe, workdir)
            row = {**base, **row, "wall_s": time.perf_counter() - t0, "env": env}
            ok = not row.get("error") and not row.get("skipped")
            if ref is None and ok:
                ref = row
            row = _check(row, rung, ref, prev, recipe)
            prev = row if ok else None  # "previous" means the rung just before, or no check
            _emit(spec, rows, row, on_row, i, total)
            if search and rung.name.startswith("fast: "):
                following = search.next(row, recipe)
                for label, why in search.drain_skipped():  # a row says why it was not tried
                    _emit(spec, rows, {**base, "rung": f"fast: not tried: {label}",
                                       "comment": "fast preset search", "skipped": why,
                                       "error": None, "env": env}, on_row, i, total)
                if following:
                    plan.insert(i + 1, following)
        if spec.peer:
            best = _best(rows, search) if spec.confirm else None
            if best is None:
                _emit(spec, rows, _peer_row(spec, wl, env, workdir, ref, on_start, i + 1, total),
                      on_row, i + 1, total)
            else:
                _Confirmation(spec, wl, env, workdir, rows, best, ref, on_start, on_row,
                              i + 1, total).run()
    return rows


def _emit(spec: LadderSpec, rows: list[dict], row: dict, on_row, i: int, total: int) -> None:
    rows.append(row)
    if spec.out:
        append_row(spec.out, row)
    if on_row:
        on_row(row, i, total)


def _best(rows: list[dict], search: FastSearch | None) -> dict | None:
    """The rung the peer is compared with: the fast search's kept candidate, else the fastest
    rung that ran and did not fail parity."""
    if search is not None:
        return search.best
    ok = [r for r in rows if r.get("kind") == "ladder" and r.get("throughput")
          and not r.get("error") and (r.get("parity") or {}).get("passed") is not False]
    return max(ok, key=lambda r: r["throughput"]) if ok else None


class _Confirmation:
    """The peer measured between two fresh runs of the best rung, then once more: ours, peer,
    peer, ours (A B B A, each in a fresh process), and a third run of a side whose two fastest
    runs disagree by more than REPEAT_TOLERANCE or scatter; then a ``kind: ratio`` row
    (fasttrain.run.steadiness). The ladder's own measurement of the best rung is not one of
    them: it may have run long before, and it was picked as the fastest of several."""

    def __init__(self, spec, wl, env, workdir, rows, best, ref, on_start, on_row, i, total):
        self.spec, self.wl, self.env, self.workdir, self.rows = spec, wl, env, workdir, rows
        self.best, self.ref, self.on_start, self.on_row = best, ref, on_start, on_row
        self.i, self.total = i, total
        self.ours: list[dict] = []
        self.peers: list[dict] = []

    def _add(self, row: dict, side: list[dict]) -> None:
        side.append(row)
        _emit(self.spec, self.rows, row, self.on_row, self.i, self.total)
        self.i += 1

    def _ours(self) -> None:
        if self.on_start:
            self.on_start(f"{self.best['rung']} {_repeat_label(len(self.ours) + 1)}", self.i,
                          self.total)
        self._add(_rerun(self.spec, self.env, self.workdir, self.best, self.ref,
                         len(self.ours) + 1), self.ours)

    def _peer(self) -> None:
        self._add(_peer_row(self.spec, self.wl, self.env, self.workdir, self.ref,
                            self.on_start, self.i, self.total, repeat=len(self.peers)),
                  self.peers)

    def run(self) -> None:
        self._ours()
        self._peer()
        if self.peers[0].get("error"):
            return  # no peer, no ratio: its row says why
        self._peer()
        self._ours()
        ratio = confirmed_ratio(self.ours, self.peers)
        if ratio is not None and not ratio["steady"]:  # a tie-breaker for each side that needs one
            if needs_another(self.peers):
                self._peer()
            if needs_another(self.ours):
                self._ours()
            ratio = confirmed_ratio(self.ours, self.peers)
        if ratio is None:
            failed = next((r for r in (*self.ours, *self.peers)
                           if r.get("error") or not r.get("throughput")), {})
            ratio = {"ratio": None, "steady": False,
                     "reason": f"not confirmed: {failed.get('rung', 'a repeat')} did not run "
                               f"({failed.get('error') or 'no throughput'})"}
        best, peer = self.best, self.peers[0]
        row = {"kind": "ratio", "workload": self.spec.workload, "size": self.spec.size,
               "rung": best["rung"], "peer": peer.get("peer"),
               "throughput_unit": best.get("throughput_unit"), **ratio, "env": self.env}
        _emit(self.spec, self.rows, row, self.on_row, self.i, self.total)


def _repeat_label(n: int) -> str:
    return "(repeat)" if n == 1 else f"(repeat {n})"


def _rerun(spec, env, workdir, best, ref, n: int) -> dict:
    """The best rung measured again (its ``n``-th repeat), parity against its ladder run."""
    recipe = Recipe().replace(**best["recipe"])
    name = f"{best['rung']} {_repeat_label(n)}"
    t0 = time.perf_counter()
    again = {"kind": "ladder", "workload": spec.workload, "size": spec.size, "rung": name,
             "repeat_of": best["rung"], "comment": "measured again to confirm the ratio to the "
             "peer (ours, peer, peer, ours)", "recipe": recipe.to_dict(), "parity": None,
             **run_rung(spec, name, recipe, workdir)}
    again.update(wall_s=time.perf_counter() - t0, env=env)
    if not again.get("error"):
        again = finish_row(again, ref, recipe.precision)
        again["parity"] = {**compare(again["losses"], best["losses"], recipe.precision),
                           "against": best["rung"]}
    return again


def _peer_row(spec, wl, env, workdir, ref, on_start, i, total, repeat: int = 0) -> dict:
    """The peer's row (its ``repeat``-th repeat when > 0)."""
    label = f" {_repeat_label(repeat)}" if repeat else ""
    if on_start:
        on_start(f"peer{label}", i, total)
    out = workdir / f"peer{repeat or ''}.jsonl"
    batch = spec.base.batch or wl.default_batch
    args = [spec.workload, "--size", spec.size, "--batch", str(batch), "--steps",
            str(spec.steps), "--warmup", str(spec.warmup), "--out", str(out)]
    args += ["--device", spec.device] + (["--tiny"] if spec.size == "tiny" else [])
    err = _run_child("fasttrain.peers", args, spec.rung_timeout, workdir / f"peer{repeat or ''}.log")
    lines = out.read_text().splitlines() if out.exists() else []
    row = json.loads(lines[-1]) if lines else {"kind": "peer", "workload": spec.workload,
                                                "size": spec.size, "rung": "peer"}
    if err and not row.get("error"):
        row["error"] = err
    if repeat:
        row["repeat_of"], row["rung"] = row.get("rung"), f"{row.get('rung')}{label}"
    row["env"] = env
    if ref and not row.get("error"):
        row["speedup"] = ref["step_time_s"] / row["step_time_s"] * row["batch"] / ref["batch"]
    return row
