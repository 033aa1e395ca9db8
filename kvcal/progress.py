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
LOG_EVERY_SECONDS = 30.0  # without a terminal: a progress line at most this often while a stage runs
_clock = time.monotonic


def stage(message: str) -> None:
    """One line on stderr when a long stage starts (with a terminal or without: a log shows where the time goes)."""
    stderr_console.print(message, markup=False, highlight=False, soft_wrap=True)


@contextmanager
def progress_bar(description: str, total: int):
    """Yields `advance(n=1)`. With a terminal, a bar that disappears when done. Without one (a log file, a pipe), plain
    lines: one when the stage starts, one at the first advance after each LOG_EVERY_SECONDS (done/total, elapsed,
    an estimate of what is left) and one when done."""
    if not stderr_console.is_terminal:
        done, started, last = [0], _clock(), [_clock()]

        def line(text: str) -> None:
            stderr_console.print(f"{description}: {text}", markup=False, highlight=False, soft_wrap=True)

        def advance(n=1):
            done[0] += n
            now = _clock()
            if now - last[0] >= LOG_EVERY_SECONDS and done[0] < total:
                last[0] = now
                elapsed = now - started
                left = elapsed * (total - done[0]) / done[0] if done[0] else float("nan")
                line(f"{done[0]}/{total} after {elapsed:.0f} s (about {left:.0f} s left)")

        line(f"0/{total}")
        yield advance
        line(f"{done[0]}/{total} in {_clock() - started:.1f} s")
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
