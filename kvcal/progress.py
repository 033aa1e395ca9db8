"""Progress bars on stderr (rich), so stdout stays clean for tables and JSON; consoles that do not wrap when they
write to a file or a pipe (a log keeps whole lines and whole table cells).

A long stage says up front what it will cost: its first units of work are the probe (they run at least
PROBE_SECONDS), and if the whole stage, at their pace, would take more than LONG_SECONDS, one line gives the expected
time before the rest runs. The units of the next REVISE_SECONDS check it: when their pace puts the stage off the said
time by more than REVISE_FACTOR either way (a probe that timed warm-up: launched steps before CUDA graphs, kernel
compilation), one more line says the revised time. Without a terminal (a log, a pipe) a stage also prints a line at
most every log_every_seconds(), with the time left."""

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

PROBE_SECONDS = 2.0  # a stage's first units, timed, give its expected time
LONG_SECONDS = 30.0  # a stage expected to take longer says so after the probe
REVISE_SECONDS = 10.0  # the units after the probe that check its estimate
REVISE_FACTOR = 1.5  # an estimate off by more than this, either way, is said again
LOG_WIDTH = 1000  # columns of a console that writes to a file or pipe: tables at full width, no wrapped lines


def make_console(stderr: bool = False) -> Console:
    """A terminal gets rich's usual console; a file or pipe one that never wraps a line or truncates a cell."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=LOG_WIDTH, soft_wrap=True)


stderr_console = make_console(stderr=True)
_clock = time.monotonic


def seconds_from_env(name: str, default: float) -> float:
    """A number of seconds >= 0 from the environment variable `name` (default if unset), or a one-line error."""
    raw = os.environ.get(name, str(default))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:
        raise KvcalError(f"{name} must be a number of seconds >= 0, got '{raw}'")
    return seconds


def log_every_seconds() -> float:
    """How often, at most, a stage without a terminal prints a progress line: $KVCAL_PROGRESS_SECONDS, else 30."""
    return seconds_from_env("KVCAL_PROGRESS_SECONDS", 30)


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
    long. When the first advance itself comes PROBE_SECONDS or more after the start (a stage's setup: moving data,
    compiling kernels), it does not set the pace: the probe then times the units after it, and the estimate is that
    first stretch plus their pace for the rest."""

    def __init__(self, description: str, total: int):
        self.description, self.total = description, total
        self.started, self.done, self.probed = _clock(), 0, False
        self.first: tuple[float, int] | None = None  # (elapsed, units) of a first advance that was slow
        self.said: tuple[float, float, int] | None = None  # (expected, elapsed, units) when an estimate was said

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.total <= 0 or self.done >= self.total:
            return
        if self.probed:
            if self.said is not None:
                self._check()
            return
        elapsed = _clock() - self.started
        if self.first is None and self.done == n and elapsed >= PROBE_SECONDS:
            self.first = (elapsed, n)  # the first advance: its time may be setup, so the probe starts after it
            return
        if self.first is None:
            if elapsed >= PROBE_SECONDS:
                self._say_expected(elapsed / self.done * self.total,
                                   f"the first {self.done}/{self.total} took {elapsed:.1f} s")
            return
        first_elapsed, first_units = self.first
        if elapsed - first_elapsed >= PROBE_SECONDS:
            units, seconds = self.done - first_units, elapsed - first_elapsed
            self._say_expected(first_elapsed + seconds / units * (self.total - first_units),
                               f"the first {first_units}/{self.total} took {first_elapsed:.1f} s, the next {units} "
                               f"{seconds:.1f} s")

    def _say_expected(self, expected: float, how: str) -> None:
        self.probed = True
        if expected > LONG_SECONDS:
            _say(f"{self.description}: expect about {duration(expected)} in all ({how})")
            self.said = (expected, _clock() - self.started, self.done)

    def _check(self) -> None:
        """Once REVISE_SECONDS of units followed the said estimate: their pace for the rest, said again if it puts
        the stage off the estimate by more than REVISE_FACTOR."""
        expected, at, units_then = self.said
        elapsed = _clock() - self.started
        if elapsed - at < REVISE_SECONDS:
            return
        units, seconds = self.done - units_then, elapsed - at
        if units <= 0:
            return
        self.said = None
        revised = elapsed + seconds / units * (self.total - self.done)
        if max(revised / expected, expected / revised) > REVISE_FACTOR:
            _say(f"{self.description}: expect about {duration(revised)} in all, revised (the {units} units after "
                 f"the first {units_then} took {seconds:.1f} s)")


def _say(line: str) -> None:
    stderr_console.print(line, markup=False, highlight=False, soft_wrap=True)


@contextmanager
def progress_bar(description: str, total: int):
    """Yields `advance(n=1)`. A long stage first says its expected time (module docstring). With a terminal, a bar
    that disappears when done. Without one (a log file, a pipe), plain lines: one at the first advance after each
    log_every_seconds() (done/total, elapsed, an estimate of what is left) and one when the stage ends. A stage that
    fails before its first line leaves only the error's line."""
    estimate = Estimate(description, total)
    if not stderr_console.is_terminal:
        every = log_every_seconds()
        last = [estimate.started]

        def advance(n=1):
            estimate.advance(n)
            done, now = estimate.done, _clock()
            if now - last[0] >= every and done < total:
                last[0] = now
                elapsed = now - estimate.started
                _say(f"{description}: {done}/{total} after {elapsed:.0f} s (about {elapsed * (total - done) / done:.0f}"
                     " s left)")

        yield advance
        _say(f"{description}: {estimate.done}/{total} in {_clock() - estimate.started:.1f} s")
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

        def advance(n=1):
            progress.advance(task, n)
            estimate.advance(n)

        yield advance
