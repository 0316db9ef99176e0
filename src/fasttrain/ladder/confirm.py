"""The best rung against the peer, confirmed: ours, peer, peer, ours (A B B A), each in a fresh
process, tie-breakers where a side scatters, then a ``kind: ratio`` row."""
from __future__ import annotations

import time

from ..measure.rows import make_row
from ..measure.parity import compare_rows
from ..measure.steadiness import confirmed_ratio, needs_another
from ..recipe import Recipe
from ..run.child import ChildSpec, run_in_child
from .search import FastSearch
from .spec import emit, finish_row, run_rung, speedup


def best_rung(rows: list[dict], search: FastSearch | None) -> dict | None:
    """The rung the peer is compared with: the fast search's kept candidate, else the fastest
    rung that ran, did not fail parity and had an effect (a rung of no effect is the rung
    before it, measured again: the faster of the two is noise)."""
    if search is not None:
        return search.best
    ok = [r for r in rows if r.get("kind") == "ladder" and r.get("throughput")
          and not r.get("error") and (r.get("parity") or {}).get("passed") is not False
          and r.get("effect") != "none"]
    return max(ok, key=lambda r: r["throughput"]) if ok else None


class Confirmation:
    """The peer measured between two fresh runs of the best rung, then once more: ours, peer,
    peer, ours (A B B A, each in a fresh process), and a third run of a side whose two fastest
    runs disagree by more than REPEAT_TOLERANCE or scatter; then a ``kind: ratio`` row
    (fasttrain.measure.steadiness). The ladder's own measurement of the best rung is not one of
    them: it may have run long before, and it was picked as the fastest of several."""

    def __init__(self, spec, wl, env, workdir, rows, best, ref, on_start, on_row, i, total):
        self.spec, self.wl, self.env, self.workdir, self.rows = spec, wl, env, workdir, rows
        self.best, self.ref, self.on_start, self.on_row = best, ref, on_start, on_row
        self.i, self.total = i, total
        self.ours: list[dict] = []
        self.peers: list[dict] = []

    def _add(self, row: dict, side: list[dict]) -> None:
        side.append(row)
        emit(self.spec, self.rows, row, self.on_row, self.i, self.total)
        self.i += 1

    def _ours(self) -> None:
        if self.on_start:
            self.on_start(f"{self.best['rung']} {_repeat_label(len(self.ours) + 1)}", self.i,
                          self.total)
        self._add(_rerun(self.spec, self.env, self.workdir, self.best, self.ref,
                         len(self.ours) + 1), self.ours)

    def _peer(self) -> None:
        self._add(peer_row(self.spec, self.wl, self.env, self.workdir, self.ref,
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
        row = make_row("ratio", self.spec.workload, self.spec.size, best["rung"],
                       peer=peer.get("peer"), throughput_unit=best.get("throughput_unit"),
                       **ratio, env=self.env)
        emit(self.spec, self.rows, row, self.on_row, self.i, self.total)


def _repeat_label(n: int) -> str:
    return "(repeat)" if n == 1 else f"(repeat {n})"


def _rerun(spec, env, workdir, best, ref, n: int) -> dict:
    """The best rung measured again (its ``n``-th repeat), parity against its ladder run."""
    recipe = Recipe().replace(**best["recipe"])
    name = f"{best['rung']} {_repeat_label(n)}"
    t0 = time.perf_counter()
    again = make_row("ladder", spec.workload, spec.size, name, **{
        "repeat_of": best["rung"], "comment": "measured again to confirm the ratio to the peer "
        "(ours, peer, peer, ours)", "recipe": recipe.to_dict(), "parity": None,
        **run_rung(spec, name, recipe, workdir)})
    again.update(wall_s=time.perf_counter() - t0, env=env)
    if not again.get("error"):
        again = finish_row(again, ref, recipe.precision)
        again["parity"] = {**compare_rows(again, best, recipe.precision),
                           "against": best["rung"]}
    return again


def peer_row(spec, wl, env, workdir, ref, on_start, i, total, repeat: int = 0) -> dict:
    """The peer's row (its ``repeat``-th repeat when > 0)."""
    label = f" {_repeat_label(repeat)}" if repeat else ""
    if on_start:
        on_start(f"peer{label}", i, total)
    batch = spec.base.batch or wl.default_batch
    from .plain_peer import is_user_workload

    if is_user_workload(spec.workload):  # your model: the same workload in a plain loop
        child = ChildSpec(job="fasttrain.ladder.plain_peer:plain_peer_job",
                          workload=spec.workload, size=spec.size, device=spec.device,
                          steps=spec.steps, warmup=spec.warmup, batch=batch, data=spec.data,
                          options=spec.options)
    else:
        child = ChildSpec(job="fasttrain.peers:peer_job", workload=spec.workload,
                          size=spec.size, device=spec.device, steps=spec.steps,
                          warmup=spec.warmup, batch=batch)
    row = run_in_child(child, workdir, f"peer{repeat or ''}", spec.rung_timeout)
    if "kind" not in row:  # the child died before the peer made its row
        row = make_row("peer", spec.workload, spec.size, "peer", **row)
    if repeat:
        row["repeat_of"], row["rung"] = row.get("rung"), f"{row.get('rung')}{label}"
    row["env"] = env
    if ref and not row.get("error"):
        row["speedup"] = speedup(row, ref)
    return row
