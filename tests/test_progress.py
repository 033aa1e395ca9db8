"""Progress without a terminal: a log file gets a line when a stage starts, lines while it runs, and one when done."""

import io

from rich.console import Console

import kvcal.progress as progress


def test_progress_reaches_a_log_file(monkeypatch):
    log = io.StringIO()  # not a terminal, as a file or pipe is
    monkeypatch.setattr(progress, "stderr_console", Console(file=log, width=1000, soft_wrap=True))
    now = [100.0]
    monkeypatch.setattr(progress, "_clock", lambda: now[0])
    monkeypatch.setattr(progress, "LOG_EVERY_SECONDS", 30.0)
    progress.stage("calibrating calibquant -> a.safetensors")
    with progress.progress_bar("calibquant tau grid (4x4)", 18) as advance:
        for seconds in (10, 10, 15, 40, 5, 5):  # each step's duration
            now[0] += seconds
            advance()
        now[0] += 20
        advance(12)
    assert log.getvalue().splitlines() == [
        "calibrating calibquant -> a.safetensors",
        "calibquant tau grid (4x4): 0/18",
        "calibquant tau grid (4x4): 3/18 after 35 s (about 175 s left)",  # the first step 30 s after the start
        "calibquant tau grid (4x4): 4/18 after 75 s (about 262 s left)",  # 40 s after the last line
        "calibquant tau grid (4x4): 18/18 in 105.0 s",
    ]


def test_an_interrupted_stage_prints_no_done_line(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(progress, "stderr_console", Console(file=log, width=1000, soft_wrap=True))
    try:
        with progress.progress_bar("capturing k, v", 4) as advance:
            advance()
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert log.getvalue().splitlines() == ["capturing k, v: 0/4"]
