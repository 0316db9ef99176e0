"""The ladder's terminal view: the table grows row by row under a spinner naming the rung and
how long it has run; where stdout is not a terminal (a log, a pipe), one plain line per row as
it finishes. Either way the table with its notes at the end.

It renders rows a runner hands it; it never runs anything itself."""
from __future__ import annotations

import time
from typing import Any, Callable

from rich.console import Console, Group
from rich.live import Live
from rich.spinner import Spinner

from .table import ladder_view, plain_line, rich_table


def default_console() -> Console:
    """A terminal console; wide enough for the table when writing to a file or pipe."""
    import sys

    return Console() if sys.stdout.isatty() else Console(width=200)


Runner = Callable[[Callable[[dict, int, int], None], Callable[[str, int, int], None]], Any]
"""Runs the work, calling ``on_row(row, i, total)`` for each finished row and
``on_start(name, i, total)`` as each rung starts (``ladder.runner.run_ladder``'s hooks)."""


class Board:
    """What the live view shows: the table so far and a spinner with the running rung's
    elapsed seconds. Recomputed at every refresh (``__rich__``), so the seconds tick between
    rows, not only when a row arrives."""

    def __init__(self, title: str, console: Console):
        self.title, self.console, self.rows = title, console, []
        self.text, self.t0 = "starting", time.perf_counter()
        self.spinner = Spinner("dots")

    def start(self, text: str) -> None:
        self.text, self.t0 = text, time.perf_counter()

    def __rich__(self) -> Group:
        self.spinner.update(text=f"{self.text} ({time.perf_counter() - self.t0:.0f} s)")
        return Group(rich_table(self.rows, title=self.title, width=self.console.width),
                     self.spinner)


def show_progress(run: Runner, title: str, console: Console | None = None) -> list[dict]:
    """Call ``run`` with hooks that show each row as it finishes; the rows it reported. On
    Ctrl-C the rows so far are shown, then the interrupt goes on to the caller."""
    console = console or default_console()
    board = Board(title, console)
    try:
        if console.is_terminal:
            with Live(board, console=console, refresh_per_second=4, transient=True) as live:
                def on_row(row, i, n):
                    board.rows.append(row)
                    live.refresh()

                run(on_row, lambda name, i, n: board.start(f"rung {i + 1}/{n}: {name}"))
        else:  # a log or a pipe: a plain line per finished row, as it arrives
            def on_line(row, i, n):
                if not board.rows:
                    print(title, flush=True)
                board.rows.append(row)
                print(plain_line(row), flush=True)

            run(on_line, lambda name, i, n: None)
    except KeyboardInterrupt:
        if board.rows:
            console.print(ladder_view(board.rows, title=title, width=console.width))
        raise
    console.print(ladder_view(board.rows, title=title, width=console.width))
    return board.rows
