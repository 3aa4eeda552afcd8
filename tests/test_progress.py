"""deepseek_v41.progress: a bar on a terminal, periodic plain lines otherwise; never on stdout."""

import io
import time

import pytest

from deepseek_v41.progress import Progress


def test_a_log_gets_a_line_at_the_start_every_interval_and_at_the_end():
    log = io.StringIO()
    with Progress("job", unit="tokens", stream=log, interval=0.05, terminal=False) as progress:
        progress(0, 30, "window 1")
        deadline = time.monotonic() + 5
        while log.getvalue().count("\n") < 3 and time.monotonic() < deadline:  # started + two ticks
            time.sleep(0.01)
        progress(10, 30, "window 2")
        time.sleep(0.15)
        progress(30, 30)
    lines = log.getvalue().splitlines()
    assert lines[0] == "job: started"
    assert len(lines) >= 4 and all(line.startswith("job: ") for line in lines)
    assert any("0/30 tokens (0%)" in line and "now: window 1" in line for line in lines[1:-1])
    assert any("10/30 tokens (33%)" in line and "s left, now: window 2" in line for line in lines[1:-1])
    assert lines[-1].startswith("job: done, 30/30 tokens (100%), ")


def test_a_failure_is_logged_and_propagates():
    log = io.StringIO()
    with pytest.raises(KeyError), Progress("job", stream=log, interval=60, terminal=False) as progress:
        progress(1, 4, "step 2")
        raise KeyError("x")
    assert log.getvalue().splitlines()[-1].startswith("job: stopped (KeyError), 1/4 steps (25%)")


def test_terminal_mode_and_disabled_mode_write_no_log_lines(capsys):
    log = io.StringIO()
    with Progress("job", stream=log, terminal=True) as progress:
        for done in range(4):
            progress(done, 3, f"step {done}")
    assert "started" not in log.getvalue()
    with Progress("job", stream=log, terminal=False, enabled=False) as progress:
        progress(1, 1)
    assert "started" not in log.getvalue()
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="interval"):
        Progress("job", interval=0)
