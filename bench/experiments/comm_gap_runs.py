"""The single runs behind bench/experiments/comm_gap.md: each a named variant of the tiny GPT's 2-worker run.

    python bench/experiments/comm_gap_runs.py NAME[,KEY=VALUE...] ...   (STEPS=300 EVERY=100 by default)

Variants that need code (frozen variance, DGC, ...) come from comm_gap_variants.diff, applied to the
commit named in comm_gap.md and switched on by the environment variables it reads.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

import ray

from etrain.core.config import load_config
from etrain.core.records import read_jsonl
from etrain.driver.job import new_run_dir, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from comm import base_overrides  # noqa: E402


def main() -> None:
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    steps, every = os.environ.get("STEPS", "300"), os.environ.get("EVERY", "100")
    with tempfile.TemporaryDirectory(prefix="etrain-comm-gap-") as root:
        for spec in sys.argv[1:]:
            name, *overrides = spec.split(",")
            data = f"{Path.home()}/.cache/etrain/data"
            base = [*base_overrides(name, int(steps), root, data), f"train.eval_every={every}"]  # the last wins
            cfg = load_config("tiny", [*base, *overrides])
            run_dir = new_run_dir(cfg)
            train(cfg, run_dir, progress=False)
            records = read_jsonl(run_dir / "metrics.jsonl")
            norms = [r["grad_norm"] for r in records if r["kind"] == "train"][20:]
            evals = [(r["step"], round(r["eval_loss"], 4)) for r in records if r["kind"] == "eval"]
            clipped = sum(n > 1.0 for n in norms) / len(norms)
            print(f"{name}: eval {evals}, clipped {clipped:.1%}, median grad norm {statistics.median(norms):.3f}")


if __name__ == "__main__":
    main()
