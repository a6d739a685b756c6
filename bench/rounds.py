"""Interleaved rounds of a benchmark as the figures committed to bench/results/: each one's median and spread."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def summary(runs: list[dict]) -> dict:
    """Each numeric figure of a variant's rounds: median, min and max."""
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float)]
    return {
        k: {
            "median": statistics.median(r[k] for r in runs),
            "min": min(r[k] for r in runs),
            "max": max(r[k] for r in runs),
        }
        for k in keys
    }


def publish(report: dict, shown: str, out: str) -> dict:
    """Print the report's `shown` part (its ratios) and save the whole report to `out` (unless '')."""
    print(json.dumps(report[shown], indent=1))
    if out:
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return report


def in_own_process(script: str, args: list[str], what: str) -> dict:
    """Run `python script args...` in a fresh process and its own process group (whatever Ray or a cluster it
    started leaves behind goes with the group); the JSON of its last line of output."""
    cmd = [sys.executable, script, *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    stdout, stderr = proc.communicate()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode:
        raise SystemExit(f"{what} failed:\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def interleaved(rounds: int, variants: list[str], measure, line) -> dict[str, list[dict]]:
    """Every variant once a round, round after round (a drift in the machine's speed hits every variant alike);
    `line(variant, result)` is printed after each run."""
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for round_ in range(rounds):
        for variant in variants:
            runs[variant].append(result := measure(variant))
            print(f"round {round_ + 1}  {line(variant, result)}", flush=True)
    return runs
