"""Progress bars on stderr (rich), so stdout stays clean for tables and JSON; consoles that do not wrap when they
write to a file or a pipe (a log keeps whole lines and whole table cells)."""

from __future__ import annotations

import os
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

from kvcal.errors import KvcalError

LOG_WIDTH = 1000  # columns of a console that writes to a file or pipe: tables at full width, no wrapped lines


def make_console(stderr: bool = False) -> Console:
    """A terminal gets rich's usual console; a file or pipe one that never wraps a line or truncates a cell."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=LOG_WIDTH, soft_wrap=True)


stderr_console = make_console(stderr=True)
_clock = time.monotonic


def log_every_seconds() -> float:
    """How often, at most, a stage without a terminal prints a progress line: $KVCAL_PROGRESS_SECONDS, else 30."""
    raw = os.environ.get("KVCAL_PROGRESS_SECONDS", "30")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:
        raise KvcalError(f"KVCAL_PROGRESS_SECONDS must be a number of seconds >= 0, got '{raw}'")
    return seconds


@contextmanager
def progress_bar(description: str, total: int):
    """Yields `advance(n=1)`. With a terminal, a bar that disappears when done. Without one (a log file, a pipe), plain
    lines: one at the first advance after each log_every_seconds() (done/total, elapsed, an estimate of what is left)
    and one when the stage ends. A stage that fails before its first line leaves only the error's line."""
    if not stderr_console.is_terminal:
        every = log_every_seconds()
        done, started, last = [0], _clock(), [_clock()]

        def line(text: str) -> None:
            stderr_console.print(f"{description}: {text}", markup=False, highlight=False, soft_wrap=True)

        def advance(n=1):
            done[0] += n
            now = _clock()
            if now - last[0] >= every and done[0] < total:
                last[0] = now
                elapsed = now - started
                line(f"{done[0]}/{total} after {elapsed:.0f} s (about {elapsed * (total - done[0]) / done[0]:.0f} s "
                     "left)")

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
