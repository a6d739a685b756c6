"""A worker's build and its checkpoint writes leave no OpenMP team behind (etrain/worker/one_team.py): a second team
slowed every step of a run to 0.72x plain torch. It runs in a fresh interpreter: a team outlives the work."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, os, sys, time, torch
from etrain.worker.one_team import on_thread

torch.set_num_threads(2)
threads = lambda: len(os.listdir("/proc/self/task"))

def parallel_work(n):  # one matmul big enough for torch to split it between its threads
    a = torch.randn(n, n)
    return float((a @ a).sum())

def settled(expected):  # a freed team's threads take a moment to exit
    deadline = time.monotonic() + 10
    while threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()

before = threads()
on_thread("build", parallel_work, 512).result()
after_thread = settled(before)
try:
    on_thread("build", lambda: 1 / 0).result()
    error = None
except ZeroDivisionError as e:
    error = type(e).__name__
parallel_work(512)  # the control: the same work on this thread keeps a team (one more thread)
print(json.dumps({"before": before, "after_thread": after_thread, "after_main": settled(before + 1), "error": error}))
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc (Linux)")
def test_work_on_its_own_thread_leaves_no_team_and_keeps_its_error():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT, check=True
    )
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    print(counts)
    assert counts["after_main"] == counts["before"] + 1, "the control: work on a live thread keeps its team's thread"
    assert counts["after_thread"] == counts["before"], "the ended thread's team outlived it"
    assert counts["error"] == "ZeroDivisionError"
