"""The run directory's records: `metrics.jsonl` (one line per event) and JSON files.

Every write is whole-file atomic or a single appended line, so a crash leaves
files that parse.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash mid-write
    return records


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def truncate_after(path: Path, step: int) -> int:
    """Keep records up to `step` (a resume redoes the rest); move the others aside. Returns how many moved."""
    records = read_jsonl(path)
    keep = [r for r in records if r.get("step", 0) <= step]
    redone = [r for r in records if r.get("step", 0) > step]
    for r in redone:
        append_jsonl(path.with_name("metrics.redone.jsonl"), r)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)
    return len(redone)


def eta_s(commits: list[float], steps_left: int) -> float | None:
    """Seconds to the last step at the pace of the recent steps, from their commit times (None before two)."""
    if len(commits) < 2:
        return None
    return steps_left * (commits[-1] - commits[0]) / (len(commits) - 1)
