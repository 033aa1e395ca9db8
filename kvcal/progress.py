"""Progress bars on stderr (rich), so stdout stays clean for tables and JSON; consoles that do not wrap when they
write to a file or a pipe (a log keeps whole lines and whole table cells)."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

LOG_WIDTH = 1000  # columns of a console that writes to a file or pipe: tables at full width, no wrapped lines


def make_console(stderr: bool = False) -> Console:
    """A terminal gets rich's usual console; a file or pipe one that never wraps a line or truncates a cell."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=LOG_WIDTH, soft_wrap=True)


stderr_console = make_console(stderr=True)


@contextmanager
def progress_bar(description: str, total: int):
    """Yields `advance(n=1)`; the bar disappears when done. Without a terminal, one line when done instead."""
    if not stderr_console.is_terminal:
        done, started = [0], time.perf_counter()

        def advance(n=1):
            done[0] += n

        yield advance
        stderr_console.print(f"{description}: {done[0]}/{total} in {time.perf_counter() - started:.1f} s",
                             highlight=False)
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=stderr_console,
        transient=True,
    ) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)
