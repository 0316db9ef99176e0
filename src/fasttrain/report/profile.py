"""Terminal rendering of a profile row: breakdown, kernels, memory, findings (rows only)."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table


def breakdown_table(p: dict) -> Table:
    over = p.get("profiling_overhead")
    title = (f"step {p['step_time_s'] * 1e3:,.1f} ms · {p['throughput']:,.1f} {p['throughput_unit']}"
             + (f" · hook overhead {over:+.1%}" if over is not None else ""))
    t = Table(title=title, header_style="bold")
    for col in ("part", "ms", "% of step"):
        t.add_column(col, justify="left" if col == "part" else "right")
    for row in p["breakdown"]:
        t.add_row(row["part"], f"{row['s'] * 1e3:,.2f}", f"{row['share']:.1%}")
    return t


def kernel_table(k: dict) -> Table | None:
    if not k.get("gpu_ms_per_step"):
        return None
    memsets = k.get("memsets_per_step", 0)
    t = Table(title=f"GPU kernels: {k['launches_per_step']:,.0f} launches/step"
              + (f" ({memsets:,.0f} memsets)" if memsets else "")
              + f", idle {k['idle_fraction']:.1%} of the window", header_style="bold")
    for col in ("category", "ms/step", "share"):
        t.add_column(col, justify="left" if col == "category" else "right")
    for cat, ms in k["gpu_ms_per_step"].items():
        t.add_row(cat, f"{ms:,.2f}", f"{k['share'][cat]:.1%}")
    return t


def memory_table(m: dict) -> Table:
    t = Table(title="memory (MiB)", header_style="bold")
    t.add_column("what")
    t.add_column("MiB", justify="right")
    for k, v in m.get("persistent_mib", {}).items():
        t.add_row(k.replace("_", " "), f"{v:,.1f}")
    for key in ("activations_mib", "peak_allocated_mib", "allocator_slack_mib", "peak_reserved_mib",
                "device_used_mib", "growth_mib_per_step", "cuda_malloc_per_step"):
        if m.get(key) is not None:
            t.add_row(key.replace("_mib", "").replace("_", " "), f"{m[key]:,.1f}")
    if m.get("reserved_pattern"):
        t.add_row("reserved memory", m["reserved_pattern"])
    t.add_row("allocator settings", str(m.get("allocator_conf") or "default"))
    return t


def findings_table(findings: list[dict]) -> Table:
    t = Table(title="advisor (largest expected gain first)", header_style="bold")
    for col in ("#", "finding", "switch", "gain"):
        t.add_column(col, overflow="fold")
    for i, f in enumerate(findings, 1):
        switch = ", ".join(f"{k}={v}" for k, v in f["switch"].items()) or ", ".join(
            f"{k}={v} (env)" for k, v in f.get("env", {}).items()) or "–"
        t.add_row(str(i), f"{f['rule']}: {f['evidence']}", switch, f"~{f['gain']:.0%}")
    if not findings:
        t.add_row("–", "nothing to suggest for this recipe", "", "")
    return t


def render(p: dict) -> Group:
    parts = [breakdown_table(p)]
    if p.get("modules_note"):
        parts.append(f"[dim]{p['modules_note']}[/dim]")
    k = kernel_table(p.get("kernels", {}))
    if k is not None:
        parts.append(k)
    trace = p.get("kernels", {}).get("trace") or {}
    if trace:
        parts.append(f"trace: {trace['path']} ({trace['mb']:.1f} MB; Perfetto or TensorBoard)")
    parts.append(f"attention: {p.get('attention')}")
    if p.get("compile"):
        parts.append(f"compile: {p['compile']} (warm-up {p['warmup_s']:.1f} s)")
    parts += [memory_table(p.get("memory", {})), findings_table(p.get("findings", []))]
    return Group(*parts)
