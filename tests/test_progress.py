"""What the driver shows off a terminal (`ray job logs`, a file): one progress line per interval, each step once."""

from __future__ import annotations

import re
import time

import pytest
from runs import FAST

from app.job import new_run_dir, train

pytestmark = pytest.mark.usefixtures("ray_session")


def test_off_a_terminal_progress_is_one_line_per_interval(make_cfg, capsys):
    """Issue 16, item 2: under `ray job logs` the bar printed 470-542 lines for 300 steps, steps repeated."""
    cfg = make_cfg(*FAST, "run.name=lines", "train.steps=150", "train.eval_every=50")
    run_dir = new_run_dir(cfg)
    started = time.monotonic()
    train(cfg, run_dir, progress=True, log_every=1.0)
    took = time.monotonic() - started
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if re.match(r"step \d+/150 \(", line)]
    steps = [int(re.match(r"step (\d+)/", line).group(1)) for line in lines]
    assert steps == sorted(set(steps)) and steps[-1] == 150  # each step once, in order, the last one at the end
    assert 2 <= len(lines) <= took + 2, f"{len(lines)} progress lines in {took:.1f} s"
    assert all(" loss " in line and "tokens/s" in line and "ETA" in line for line in lines)
    assert "ETA -" not in lines[-1] and "\r" not in err  # an ETA from the pace, and no bar redrawn into the log
    assert len([line for line in err.splitlines() if re.match(r"step \d+: eval loss", line)]) == 3  # events: lines of their own
