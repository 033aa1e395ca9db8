"""Progress on stderr: a long stage says its expected time after a short timed probe of its first units, and without a
terminal reports every tenth of its work; a short one says nothing until it is done."""

from __future__ import annotations

import pytest

from kvcal import progress


@pytest.fixture()
def fake_clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(progress, "clock", lambda: now[0])
    return now


def run_stage(fake_clock, total: int, seconds_per_unit: float, first_unit: float | None = None) -> None:
    with progress.progress_bar("stage", total) as advance:
        for i in range(total):
            fake_clock[0] += first_unit if (i == 0 and first_unit is not None) else seconds_per_unit
            advance()


def test_a_long_stage_prints_its_expected_time_after_the_probe_then_every_tenth(fake_clock, capsys):
    run_stage(fake_clock, 100, 1.0)  # 100 units of 1 s: the probe is the first 2 (PROBE_SECONDS), 100 s expected
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "stage: expect about 1 min 40 s in all (the first 2/100 took 2.0 s)"
    assert lines[1:10] == ["stage: 10/100 in 10 s, about 1 min 30 s left", "stage: 20/100 in 20 s, about 80 s left",
                           "stage: 30/100 in 30 s, about 70 s left", "stage: 40/100 in 40 s, about 60 s left",
                           "stage: 50/100 in 50 s, about 50 s left", "stage: 60/100 in 60 s, about 40 s left",
                           "stage: 70/100 in 70 s, about 30 s left", "stage: 80/100 in 80 s, about 20 s left",
                           "stage: 90/100 in 1 min 30 s, about 10 s left"]
    assert lines[10:] == ["stage: 100/100 in 100.0 s"]


def test_the_estimate_comes_from_the_probe_and_is_said_in_minutes(fake_clock, capsys):
    # a first unit of 3 s, then 10 s each: the estimate is the probe's pace (3 s x 600 = 30 min), said once
    run_stage(fake_clock, 600, 10.0, first_unit=3.0)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "stage: expect about 30 min in all (the first 1/600 took 3.0 s)"
    # 3 + 59 x 10 = 593 s for 60 units, so 593 / 60 x 540 = 5337 s for the rest
    assert lines[1] == "stage: 60/600 in 9 min 53 s, about 89 min left"


def test_a_short_stage_prints_only_its_last_line(fake_clock, capsys):
    run_stage(fake_clock, 10, 1.0)  # 10 s expected: under LONG_SECONDS
    assert capsys.readouterr().err.splitlines() == ["stage: 10/10 in 10.0 s"]
