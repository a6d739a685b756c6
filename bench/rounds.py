"""Interleaved rounds of a benchmark as the figures committed to bench/results/: each one's median and spread."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


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
