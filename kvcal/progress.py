"""Progress bars on stderr (rich), so stdout stays clean for tables and JSON; consoles that do not wrap when they
write to a file or a pipe (a log keeps whole lines and whole table cells).

A long stage says up front what it will cost: its first units of work are the probe (they run at least
PROBE_SECONDS), and if the whole stage, at their pace, would take more than LONG_SECONDS, one line gives the expected
time before the rest runs. Without a terminal (a log, a pipe) such a stage also prints a line at every tenth of its
work, with the time left."""

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

PROBE_SECONDS = 2.0  # a stage's first units, timed, give its expected time
LONG_SECONDS = 30.0  # a stage expected to take longer announces its time (and reports every tenth without a terminal)
LOG_WIDTH = 1000  # columns of a console that writes to a file or pipe: tables at full width, no wrapped lines


def make_console(stderr: bool = False) -> Console:
    """A terminal gets rich's usual console; a file or pipe one that never wraps a line or truncates a cell."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=LOG_WIDTH, soft_wrap=True)


stderr_console = make_console(stderr=True)


def clock() -> float:
    """Seconds on the clock the estimates read (a monotonic one)."""
    return time.perf_counter()


def duration(seconds: float) -> str:
    """'45 s', '1 min 40 s', '12 min', '2.5 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 10 * 60:
        return f"{int(seconds // 60)} min {seconds % 60:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Estimate:
    """The expected time of a stage of `total` units from its first ones (the probe), said once when the stage looks
    long; with `every_tenth`, a line at each tenth of the work after that."""

    def __init__(self, description: str, total: int, say, every_tenth: bool):
        self.description, self.total, self.say, self.every_tenth = description, total, say, every_tenth
        self.started, self.done = clock(), 0
        self.probed = self.long = False
        self.next_report = 0

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.total <= 0 or self.done >= self.total:
            return
        elapsed = clock() - self.started
        if not self.probed and elapsed >= PROBE_SECONDS:
            self.probed = True
            expected = elapsed / self.done * self.total
            if expected > LONG_SECONDS:
                self.long = True
                self.say(f"{self.description}: expect about {duration(expected)} in all (the first "
                         f"{self.done}/{self.total} took {elapsed:.1f} s)")
                self.next_report = (self.done * 10 // self.total + 1) * self.total / 10
        elif self.long and self.every_tenth and self.done >= self.next_report:
            left = elapsed / self.done * (self.total - self.done)
            self.say(f"{self.description}: {self.done}/{self.total} in {duration(elapsed)}, about {duration(left)} "
                     "left")
            self.next_report = (self.done * 10 // self.total + 1) * self.total / 10


@contextmanager
def progress_bar(description: str, total: int):
    """Yields `advance(n=1)`; the bar disappears when done. Without a terminal, one line when done instead. A long
    stage prints its expected time after its first units (module docstring)."""
    if not stderr_console.is_terminal:
        estimate = Estimate(description, total, _say, every_tenth=True)
        yield estimate.advance
        stderr_console.print(f"{description}: {estimate.done}/{total} in {clock() - estimate.started:.1f} s",
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
        estimate = Estimate(description, total, _say, every_tenth=False)  # the bar shows the time left

        def advance(n=1):
            progress.advance(task, n)
            estimate.advance(n)

        yield advance


def _say(line: str) -> None:
    stderr_console.print(line, highlight=False, markup=False)
