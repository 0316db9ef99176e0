"""Run a ladder: each rung in its own process, rows appended as they finish, parity vs fp32."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from ..errors import FasttrainError
from ..measure.env import environment
from ..measure.parity import compare_rows
from ..recipe import Recipe
from ..run.loop import load_dataset
from ..run.scratch import scratch
from ..techniques import unmet_requirements
from ..workloads import load_workload
from ..measure.rows import make_row
from .confirm import Confirmation, best_rung, peer_row
from .rungs import Rung, build_ladder
from .search import FastSearch, fast_plan
from .spec import LadderSpec, emit, finish_row, mark_effect, run_rung


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
        row["parity"] = {**compare_rows(row, against, recipe.precision),
                         "against": against["rung"]}
    return row


def _base_out_of_memory(row: dict, recipe: Recipe) -> bool:
    """The fp32 base ran out of device memory with every activation kept (Llama-1B's math
    attention at 4 x 2,048 tokens needs about 84 GiB)."""
    return (recipe.precision == "fp32" and recipe.checkpointing == "none"
            and str(row.get("error") or "").startswith("out of memory"))


def _checkpointed_base(spec: LadderSpec, rung: Rung, recipe: Recipe, row: dict,
                       workdir) -> tuple[Rung, Recipe, dict]:
    """The fp32 base again, every block checkpointed: the same maths, so the parity reference
    stays exact, with only the blocks' inputs kept. Its time includes the recompute, so the
    speed-ups against it come out higher than against plain fp32; the rung's name and comment
    say so, and the row keeps the first run's error (``base_out_of_memory``). Where the second
    run fails too, the first row comes back with both errors."""
    retry = replace(recipe, checkpointing="full")
    again = run_rung(spec, rung.name, retry, workdir)
    if again.get("error") or again.get("skipped"):
        why = again.get("error") or again.get("skipped")
        return rung, recipe, {**row, "error": f"{row['error'].rstrip('.')}; again with full "
                                               f"activation checkpointing: {why}"}
    named = replace(rung, name=f"{rung.name} (checkpointed)",
                    comment=f"{rung.comment}; every block checkpointed, since plain fp32 ran "
                            "out of memory: the same maths, its time includes the recompute")
    return named, retry, {**again, "base_out_of_memory": row["error"]}


def _plan(spec: LadderSpec):
    wl = load_workload(spec.workload, spec.size, seed=spec.base.seed, data=spec.data,
                       **spec.options)
    if spec.data is not None:  # a wrong data path is refused once, not by every rung
        load_dataset(wl)
    plan = fast_plan(wl, spec.base) if spec.rungs == ["fast"] else \
        build_ladder(wl, spec.rungs, spec.base)
    if spec.start_at:
        names = [r.name for r, _ in plan]
        if spec.start_at not in names:
            raise FasttrainError(f"--from {spec.start_at!r} is not a rung of this ladder: use "
                                 f"{', '.join(names)}")
        i = names.index(spec.start_at)
        if i > 1:  # recipes stay cumulative; the skipped rungs just do not run
            first, rec = plan[i]
            # what it adds over the base: its changes and the skipped rungs' (mark_effect)
            first = replace(first, changes={k: v for r, _ in plan[1:i + 1]
                                            for k, v in r.changes.items()})
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
    with scratch("ladder") as workdir:
        i = -1
        while i + 1 < len(plan):
            i += 1
            rung, recipe = plan[i]
            if on_start:
                on_start(rung.name, i, total)
            base = make_row("ladder", spec.workload, spec.size, rung.name,
                            comment=rung.comment, device=spec.device,
                            recipe=recipe.to_dict(), parity=None)
            unmet = unmet_requirements(recipe, spec.device.split(":")[0])
            t0 = time.perf_counter()
            row = {"skipped": "; ".join(unmet), "error": None} if unmet else run_rung(
                spec, rung.name, recipe, workdir)
            if i == 0 and _base_out_of_memory(row, recipe):
                rung, recipe, row = _checkpointed_base(spec, rung, recipe, row, workdir)
                base = {**base, "rung": rung.name, "comment": rung.comment,
                        "recipe": recipe.to_dict()}
            row = {**base, **row, "wall_s": time.perf_counter() - t0, "env": env}
            ok = not row.get("error") and not row.get("skipped")
            if ref is None and ok:
                ref = row
            row = _check(row, rung, ref, prev, recipe)
            if row is not ref:
                row = mark_effect(row, rung.changes)
            prev = row if ok else None  # "previous" means the rung just before, or no check
            emit(spec, rows, row, on_row, i, total)
            if search and rung.name.startswith("fast: "):
                following = search.next(row, recipe)
                for label, why in search.drain_skipped():  # a row says why it was not tried
                    emit(spec, rows, {**base, "rung": f"fast: not tried: {label}",
                                       "comment": "fast preset search", "skipped": why,
                                       "error": None, "env": env}, on_row, i, total)
                if following:
                    plan.insert(i + 1, following)
        if spec.peer:
            best = best_rung(rows, search) if spec.confirm else None
            if best is None:
                emit(spec, rows, peer_row(spec, wl, env, workdir, ref, on_start, i + 1, total),
                      on_row, i + 1, total)
            else:
                Confirmation(spec, wl, env, workdir, rows, best, ref, on_start, on_row,
                              i + 1, total).run()
    return rows




def failures(rows: list[dict]) -> str | None:
    """Why the ladder failed, on one line, or None: a rung that errored or failed parity, a
    peer that errored, or a ladder where every rung was skipped (nothing was measured)."""
    bad = []
    for r in rows:
        if r.get("kind") not in ("ladder", "peer"):
            continue
        name = r.get("rung") or r.get("kind")
        if r.get("error"):
            bad.append(f"{name} (error)")
        elif (r.get("parity") or {}).get("passed") is False:
            bad.append(f"{name} (parity)")
    rungs = [r for r in rows if r.get("kind") == "ladder"]
    if rungs and all(r.get("skipped") for r in rungs):
        bad.append(f"every rung was skipped ({rungs[0]['skipped']})")
    return ", ".join(bad) or None
