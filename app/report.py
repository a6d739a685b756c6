"""Run summary from the run directory's metrics: what `summary.json` and `etrain report` show."""

from __future__ import annotations

import time
from pathlib import Path

from app.config import Config
from app.metrics import read_jsonl


def summarize(metrics_path: Path, cfg: Config, started_at: float, first_step_at: float | None) -> dict:
    records = read_jsonl(metrics_path)
    # A step committed by survivors of a lost worker has no complete loss: it counts, but is not averaged.
    steps = [r for r in records if r["kind"] == "train"]
    train = [r for r in steps if r.get("loss") is not None]
    evals = [r for r in records if r["kind"] == "eval"]
    steady = train[1:] or train  # the first step pays for warm-up (allocations, gloo buffers)
    seq = cfg.model.seq_len
    return {
        "steps": steps[-1]["step"] if steps else 0,
        "samples": steps[-1]["samples"] if steps else 0,
        "tokens": (steps[-1]["samples"] if steps else 0) * seq,
        "first_loss": train[0]["loss"] if train else None,
        "final_loss": train[-1]["loss"] if train else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "tokens_per_s": seq * sum(r["batch"] for r in steady) / sum(r["step_time_s"] for r in steady) if steady else None,
        "wall_s": time.time() - started_at,
        "startup_s": first_step_at - started_at if first_step_at else None,
        "world_size": steps[-1]["world_size"] if steps else cfg.cluster.num_workers,
        "config_hash": cfg.hash(),
    }
