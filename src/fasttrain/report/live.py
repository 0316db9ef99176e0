"""The ladder's terminal view: the table grows row by row under a spinner naming the rung.

It renders rows a runner hands it; it never runs anything itself."""
from __future__ import annotations

import time
from typing import Any, Callable

from rich.console import Console, Group
from rich.live import Live
from rich.spinner import Spinner

from .table import rich_table


def default_console() -> Console:
    """A terminal console; wide enough for the table when writing to a file or pipe."""
    import sys

    return Console() if sys.stdout.isatty() else Console(width=200)


Runner = Callable[[Callable[[dict, int, int], None], Callable[[str, int, int], None]], Any]
"""Runs the work, calling ``on_row(row, i, total)`` for each finished row and
``on_start(name, i, total)`` as each rung starts (``ladder.runner.run_ladder``'s hooks)."""


def show_progress(run: Runner, title: str, console: Console | None = None) -> list[dict]:
    """Call ``run`` with hooks that grow the table under a spinner; the rows it reported.
    The view only renders: what runs is the caller's."""
    console = console or default_console()
    rows: list[dict] = []
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

        run(on_row, on_start)
    console.print(rich_table(rows, title=title))
    return rows
