"""The ladder's terminal view: the table grows row by row under a spinner naming the rung."""
from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.spinner import Spinner

from .table import rich_table


def default_console() -> Console:
    """A terminal console; wide enough for the table when writing to a file or pipe."""
    import sys

    return Console() if sys.stdout.isatty() else Console(width=200)


def run_with_progress(spec, console: Console | None = None) -> list[dict]:
    from ..ladder.runner import run_ladder

    console = console or default_console()
    rows: list[dict] = []
    title = f"fasttrain ladder · {spec.workload} {spec.size} · {spec.device}"
    status = {"text": "starting", "t0": time.perf_counter()}

    def render():
        spin = Spinner("dots", text=f"{status['text']} "
                       f"({time.perf_counter() - status['t0']:.0f} s)")
        return Group(rich_table(rows, title=title), spin)

    with Live(render(), console=console, refresh_per_second=4, transient=True) as live:
        def on_start(name, i, n):
            status.update(text=f"rung {i + 1}/{n}: {name}", t0=time.perf_counter())
            live.update(render())

        def on_row(row, i, n):
            rows.append(row)
            live.update(render())

        run_ladder(spec, on_row=on_row, on_start=on_start)
    console.print(rich_table(rows, title=title))
    return rows
