"""The run directory's records: `metrics.jsonl` (one line per event) and JSON files.

Every write is whole-file atomic or a single appended line, so a crash leaves
files that parse.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from app.core.config import Config


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


def summarize(metrics_path: Path, cfg: Config, started_at: float, first_step_at: float | None) -> dict:
    """summary.json: what the run did, from its records."""
    records = read_jsonl(metrics_path)
    # A step committed by survivors of a lost worker has no complete loss: it counts, but is not averaged.
    steps = [r for r in records if r["kind"] == "train"]
    train = [r for r in steps if r.get("loss") is not None]
    evals = [r for r in records if r["kind"] == "eval"]
    seq = cfg.model.seq_len
    return {
        "steps": steps[-1]["step"] if steps else 0,
        "samples": steps[-1]["samples"] if steps else 0,
        "tokens": (steps[-1]["samples"] if steps else 0) * seq,
        "first_loss": train[0]["loss"] if train else None,
        "final_loss": train[-1]["loss"] if train else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "tokens_per_s": steady_tokens_per_s(steps),
        "wall_s": time.time() - started_at,
        "startup_s": first_step_at - started_at if first_step_at else None,
        "world_size": steps[-1]["world_size"] if steps else cfg.cluster.num_workers,
        "config_hash": cfg.hash(),
    }


def steady_tokens_per_s(train: list[dict]) -> float | None:
    """Tokens per second over the steps with every member's result, after the first (it pays for warm-up:
    allocations, gloo buffers): their tokens over their time."""
    done = [r for r in train if r.get("loss") is not None and r.get("step_time_s")]
    steady = done[1:] or done
    seconds = sum(r["step_time_s"] for r in steady)
    return sum(r["tokens_per_s"] * r["step_time_s"] for r in steady) / seconds if seconds else None
