"""Progress: a long stage says its expected time after a short timed probe of its first units; without a terminal a log
file gets a line at most every N seconds while a stage runs, and one when done."""

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
        # the first step (10 s, over PROBE_SECONDS) may be setup: the pace is the next one's (10 s)
        "calibquant tau grid (4x4): expect about 3 min 0 s in all (the first 1/18 took 10.0 s, the next 1 10.0 s)",
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


def run_stage(now, total: int, seconds_per_unit: float, first_unit: float | None = None) -> None:
    with progress.progress_bar("stage", total) as advance:
        for i in range(total):
            now[0] += first_unit if (i == 0 and first_unit is not None) else seconds_per_unit
            advance()


@pytest.fixture
def quiet_log(log, monkeypatch):
    """A log with a fake clock and no periodic lines: only the estimate and the last line."""
    now = [1000.0]
    monkeypatch.setattr(progress, "_clock", lambda: now[0])
    monkeypatch.setenv("KVCAL_PROGRESS_SECONDS", "1e9")
    return now


def test_a_long_stage_prints_its_expected_time_after_the_probe(quiet_log, log):
    run_stage(quiet_log, 100, 1.0)  # 100 units of 1 s: the probe is the first 2 (PROBE_SECONDS), 100 s expected
    assert log.getvalue().splitlines() == ["stage: expect about 1 min 40 s in all (the first 2/100 took 2.0 s)",
                                           "stage: 100/100 in 100.0 s"]


def test_the_estimate_comes_from_the_probe_and_is_said_in_minutes_or_hours(quiet_log, log):
    run_stage(quiet_log, 600, 0.5)  # units of 0.5 s: the probe is the first 4 (PROBE_SECONDS), 300 s expected
    assert log.getvalue().splitlines()[0] == "stage: expect about 5 min 0 s in all (the first 4/600 took 2.0 s)"
    run_stage(quiet_log, 600, 3.0)  # units of 3 s: the first may be setup, the next one's pace: 3 + 599 x 3 s
    assert log.getvalue().splitlines()[2] == "stage: expect about 30 min in all (the first 1/600 took 3.0 s, the next 1 3.0 s)"
    assert progress.duration(45) == "45 s" and progress.duration(9000) == "2.5 h"


def test_a_slow_first_unit_is_setup_not_the_pace(quiet_log, log):
    run_stage(quiet_log, 600, 1.0, first_unit=300.0)  # 300 s of setup, then 599 units of 1 s: 899 s, not 50 h
    assert log.getvalue().splitlines() == [
        "stage: expect about 15 min in all (the first 1/600 took 300.0 s, the next 2 2.0 s)",
        "stage: 600/600 in 899.0 s"]


def test_an_estimate_off_by_more_than_the_factor_is_revised_once(quiet_log, log):
    # a probe that timed warm-up: 2 units of 1 s say 10000 s; the next 10 s (REVISE_SECONDS) run 640 units of
    # 1/64 s, and the stage ends in 12 + 9358 / 64 = 158.2 s (a value training's launched steps before its graphs)
    with progress.progress_bar("stage", 10000) as advance:
        for i in range(10000):
            quiet_log[0] += 1.0 if i < 2 else 1 / 64
            advance()
    lines = log.getvalue().splitlines()
    assert lines[:2] == ["stage: expect about 2.8 h in all (the first 2/10000 took 2.0 s)",
                         "stage: expect about 2 min 38 s in all, revised (the 640 units after the first 2 took 10.0 s)"]
    assert lines[2:] == ["stage: 10000/10000 in 158.2 s"]  # said again once only
    log.truncate(0)
    log.seek(0)
    run_stage(quiet_log, 600, 3.0, first_unit=1.0)  # within the factor (1 + 599 x 3 said, 1 + 599 x 3 run): not said
    assert len(log.getvalue().splitlines()) == 2


def test_a_short_stage_prints_only_its_last_line(quiet_log, log):
    run_stage(quiet_log, 10, 1.0)  # 10 s expected: under LONG_SECONDS
    assert log.getvalue().splitlines() == ["stage: 10/10 in 10.0 s"]
