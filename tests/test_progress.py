"""What the driver shows off a terminal (`ray job logs`, a file): one progress line per interval, each step once."""

from __future__ import annotations

import re
import time

import pytest

from etrain.driver.job import new_run_dir, train
from etrain.driver.progress import Progress

from helpers.runs import FAST, start_driver


def record(step: int) -> dict:
    return {"step": step, "loss": 2.0, "tokens_per_s": 1000.0, "world_size": 2}


@pytest.mark.parametrize("interval_at_end", [True, False])
def test_the_last_step_is_printed_once_whether_or_not_an_interval_just_printed_it(interval_at_end, capsys):
    """CI at 66b01c9: the interval's line fell on step 150 and close() printed step 150 again."""
    progress = Progress(total=3, every=3600.0)
    progress.step(record(1))
    progress.step(record(2))
    if interval_at_end:
        progress.next_line = 0.0  # the interval is due as the last step commits
    progress.step(record(3))
    progress.close()
    steps = [int(m) for m in re.findall(r"^step (\d+)/3 ", capsys.readouterr().err, re.M)]
    assert steps == [3]


@pytest.mark.usefixtures("ray_session")
def test_off_a_terminal_progress_is_one_line_per_interval(make_cfg, capsys):
    """Issue 16, item 2: under `ray job logs` the bar printed 470-542 lines for 300 steps, steps repeated."""
    cfg = make_cfg(*FAST, "run.name=lines", "train.steps=60", "train.eval_every=20")
    run_dir = new_run_dir(cfg)
    started = time.monotonic()
    train(cfg, run_dir, progress=True, log_every=1.0)
    took = time.monotonic() - started
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if re.match(r"step \d+/60 \(", line)]
    steps = [int(re.match(r"step (\d+)/", line).group(1)) for line in lines]
    assert steps == sorted(set(steps)) and steps[-1] == 60  # each step once, in order, the last one at the end
    assert 2 <= len(lines) <= took + 2, f"{len(lines)} progress lines in {took:.1f} s"
    assert all(" loss " in line and "tokens/s" in line and "ETA" in line for line in lines)
    assert "ETA -" not in lines[-1] and "\r" not in err  # an ETA from the pace, and no bar redrawn into the log
    # events: lines of their own
    assert len([line for line in err.splitlines() if re.match(r"step \d+: eval loss", line)]) == 3


@pytest.mark.usefixtures("ray_session")
def test_a_recovery_shows_our_line_and_keeps_rays_noise_in_the_log(make_cfg, tmp_path):
    """Issue 16, item 2: a recovered worker death printed Ray's raylet paragraph and "Unhandled error"
    tracebacks ahead of the one-line `recover` message. The driver's terminal has our line; the log has Ray's."""
    cfg = make_cfg(*FAST, "run.name=noise", "train.steps=40", "faults=[{rank: 1, step: 10, kind: kill}]")
    driver = start_driver(cfg, tmp_path)
    _, err = driver.communicate(timeout=180)
    assert driver.returncode == 0, err
    assert re.search(r"step 9: recover 2 -> \d workers", err), err
    for noise in ("A worker died", "Unhandled error", "Traceback", "(raylet)"):
        assert noise not in err, noise
    assert "A worker died" in (tmp_path / "runs" / "noise" / "driver.log").read_text()
