"""Does an elastic run learn what a fixed run learns? Side by side in one Ray instance, in interleaved rounds:

- fixed: 2 workers throughout;
- elastic: 2 -> 3 workers (`etrain scale`), a worker killed (it is replaced or the group shrinks), then back to 2
  (`etrain scale`), at a constant global batch;
- elastic, linear: the same changes with `train.batch_scaling=linear` (the batch and the learning rate grow with
  the workers): not meant to be equal, its difference is reported.

Each run trains the tiny GPT on the embedded corpus with the same seed and evaluates on the held-out split at its
last step. Reported: final eval losses and the relative gap of each elastic variant to the fixed run.

    python bench/equivalence.py [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import ray
from rounds import summary

from etrain.core.config import load_config
from etrain.core.records import read_jsonl
from etrain.driver import api
from etrain.driver.job import new_run_dir, train

RESULTS = Path(__file__).resolve().parent / "results"


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == kind]


def drive(run_dir: Path, steps: int) -> None:
    """2 -> 3 as soon as a pool worker is ready; back to 2 once the killed worker's step has passed."""
    coordinator = api.coordinator(str(run_dir), wait_s=120)
    while ray.get(coordinator.status.remote())["warm_pool_ready"] < 1:
        time.sleep(0.1)
    api.scale(str(run_dir), 3)
    while ray.get(coordinator.status.remote())["step"] < int(steps * 0.7):
        time.sleep(0.1)
    api.scale(str(run_dir), 2)


def one_run(variant: str, steps: int, data: str, root: Path) -> dict:
    name = f"{variant}-{time.monotonic_ns()}"
    overrides = [
        f"data.cache_dir={data}",
        f"run.root={root}",
        f"run.name={name}",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
        "checkpoint.every=0",
        "cluster.warm_pool=1",
        "train.deterministic=true",
    ]
    if variant != "fixed":
        overrides.append(f"faults=[{{rank: 1, step: {steps // 2}, kind: kill}}]")
    if variant == "elastic_linear":
        overrides.append("train.batch_scaling=linear")
    cfg = load_config("tiny", overrides)
    run_dir = new_run_dir(cfg)
    driver = None
    if variant != "fixed":
        driver = threading.Thread(target=drive, args=(run_dir, steps), daemon=True)
        driver.start()
    train(cfg, run_dir, progress=False)
    if driver is not None:
        driver.join(timeout=5)
    changes = [(m["reason"], m["world_before"], m["world_after"]) for m in records(run_dir, "membership")]
    return {"eval_loss": records(run_dir, "eval")[-1]["eval_loss"], "changes": changes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    variants = ("fixed", "elastic", "elastic_linear")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "data")
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for variant in order:
                runs[variant].append(one_run(variant, args.steps, data, Path(tmp) / "runs"))
            fixed = runs["fixed"][-1]["eval_loss"]
            for variant in ("elastic", "elastic_linear"):
                runs[variant][-1]["gap_vs_fixed"] = runs[variant][-1]["eval_loss"] / fixed - 1
            print(f"round {r + 1}: " + json.dumps({v: runs[v][-1] for v in variants}), flush=True)
    result = {
        "what": f"tiny GPT, {args.steps} steps, eval loss at the last step; elastic: 2 -> 3 workers, rank 1 killed at "
        f"step {args.steps // 2}, back to 2 at step {int(args.steps * 0.7)}; median of {args.rounds} interleaved "
        "rounds with min and max",
        **{v: summary(runs[v]) for v in variants},
        "changes": {v: runs[v][-1]["changes"] for v in variants},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "equivalence.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
