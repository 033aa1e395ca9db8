"""Progress without a terminal: a log file gets a line at most every N seconds while a stage runs, and one when done."""

import io

import pytest
from rich.console import Console

import kvcal.progress as progress
from kvcal.errors import KvcalError


@pytest.fixture
def log(monkeypatch):
    stream = io.StringIO()  # not a terminal, as a file or pipe is
    monkeypatch.setattr(progress, "stderr_console", Console(file=stream, width=1000, soft_wrap=True))
    return stream


def test_progress_reaches_a_log_file(log, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress, "_clock", lambda: now[0])
    monkeypatch.delenv("KVCAL_PROGRESS_SECONDS", raising=False)  # every 30 s
    with progress.progress_bar("calibquant tau grid (4x4)", 18) as advance:
        for seconds in (10, 10, 15, 40, 5, 5):  # each step's duration
            now[0] += seconds
            advance()
        now[0] += 20
        advance(12)
    assert log.getvalue().splitlines() == [
        "calibquant tau grid (4x4): 3/18 after 35 s (about 175 s left)",  # the first step 30 s after the start
        "calibquant tau grid (4x4): 4/18 after 75 s (about 262 s left)",  # 40 s after the last line
        "calibquant tau grid (4x4): 18/18 in 105.0 s",
    ]


def test_the_interval_is_set_by_the_environment(log, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress, "_clock", lambda: now[0])
    monkeypatch.setenv("KVCAL_PROGRESS_SECONDS", "5")
    with progress.progress_bar("capturing k, v", 4) as advance:
        for _ in range(4):
            now[0] += 3
            advance()
    assert log.getvalue().splitlines() == ["capturing k, v: 2/4 after 6 s (about 6 s left)", "capturing k, v: 4/4 in 12.0 s"]
    monkeypatch.setenv("KVCAL_PROGRESS_SECONDS", "soon")
    with pytest.raises(KvcalError, match="KVCAL_PROGRESS_SECONDS must be a number of seconds >= 0, got 'soon'"):
        with progress.progress_bar("capturing k, v", 4):
            pass


def test_a_stage_that_fails_early_leaves_no_line(log):
    with pytest.raises(KeyboardInterrupt):
        with progress.progress_bar("capturing k, v", 4) as advance:
            advance()
            raise KeyboardInterrupt
    assert log.getvalue() == ""  # the error's own line (printed by the CLI) is the only one
