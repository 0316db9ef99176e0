"""The fast search's verdict: its kept candidate written as a recipe file next to the rows,
and a ``kind: fast`` row saying which candidate won and by how much."""
from __future__ import annotations

from pathlib import Path

from ..recipe import Recipe, to_toml
from .child import write_atomic
from .rungs import pick_fast
from .runner import append_row


def write_fast_preset(workload: str, size: str, rows: list[dict], out: Path) -> str:
    """Write ``fast-<workload>-<size>.toml`` beside ``out`` and append the ``kind: fast`` row
    to ``out``; its ratio to the peer is the confirmed one where the rows hold it. Returns the
    line to tell the user."""
    best = pick_fast(rows)
    if best is None:
        return "fast preset: no candidate ran and passed parity; nothing written"
    recipe = Recipe().replace(**best["recipe"])
    path = out.with_name(f"fast-{Path(workload.split(':')[0]).name}-{size}.toml")
    write_atomic(path, to_toml(recipe, comment=f"fasttrain fast preset for {workload} {size}: "
                                              f"{best['rung']}, {best['throughput']:,.1f} "
                                              f"{best['throughput_unit']}"))
    peer = next((r for r in rows if r.get("kind") == "peer" and not r.get("error")), None)
    ratio = next((r for r in rows if r.get("kind") == "ratio" and r.get("ratio")
                  and r["rung"] == best["rung"]), None)
    vs_peer = ratio["ratio"] if ratio else best["throughput"] / peer["throughput"] if peer else None
    append_row(out, {"kind": "fast", "workload": workload, "size": size, "rung": best["rung"],
                     "recipe": best["recipe"], "throughput": best["throughput"],
                     "throughput_unit": best["throughput_unit"], "speedup": best.get("speedup"),
                     "vs_peer": vs_peer, "vs_peer_steady": ratio["steady"] if ratio else None,
                     "recipe_file": str(path), "env": best.get("env")})
    gain = f", {best['speedup']:.2f}x fp32" if best.get("speedup") else ""
    return (f"fast preset: {best['rung']} ({best['throughput']:,.1f} {best['throughput_unit']}"
            f"{gain}) → {path} (run it: fasttrain ladder {workload} --recipe {path})")
