"""Hyper-parameter search at an equal budget of trials, side by side in one Ray instance.

TPE (Optuna, multivariate) vs random search, both with ASHA, over the same space and
the same number of trials for each of several search seeds: each search's best eval loss,
the mean difference with a bootstrap 95% interval, and the share of seeds TPE wins.
And ASHA vs no pruning (both TPE): total training steps spent, and the best loss.
Every trial trains the tiny GPT with one worker. The space is one where parameters
interact: the best lr depends on the width and on the warm-up, weight decay on the lr.

    python bench/hpo.py [--trials 48] [--seeds 5] [--steps 60] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ray

from app.core.config import load_config, override
from app.job import resolve_data, train
from tune.search import run_search

RESULTS = Path(__file__).resolve().parent / "results"
SPACE = {
    "optim.lr": {"loguniform": [1.0e-4, 3.0e-2]},
    "optim.warmup_steps": {"int": [0, 30]},
    "optim.weight_decay": {"uniform": [0.0, 0.3]},
    "optim.beta2": {"uniform": [0.9, 0.999]},
    "model.d_model": {"choice": [64, 96, 128, 160]},
}
VARIANTS = {"tpe": ("tpe", True), "random": ("random", True), "tpe_no_pruning": ("tpe", False)}


def bootstrap_difference(a: list[float], b: list[float], resamples: int = 10_000) -> list[float]:
    """95% percentile interval of mean(a) - mean(b), each side resampled on its own (the seeds are not pairs)."""
    rng = np.random.default_rng(0)
    a_, b_ = np.asarray(a), np.asarray(b)
    diffs = rng.choice(a_, (resamples, a_.size)).mean(1) - rng.choice(b_, (resamples, b_.size)).mean(1)
    return [float(np.quantile(diffs, 0.025)), float(np.quantile(diffs, 0.975))]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=48)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="training steps per trial")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument(
        "--set", action="append", default=[], help="extra config overrides (the tests shrink the corpus)"
    )
    parser.add_argument(
        "--data", default=str(Path.home() / ".cache/etrain/data"), help="where the embedded corpus is built"
    )
    parser.add_argument("--out", default=str(RESULTS / "hpo.json"), help="results file ('' to skip)")
    args = parser.parse_args(argv)
    from tune.space import parameter

    base = load_config(
        "tiny",
        [
            f"data.cache_dir={args.data}",
            f"train.steps={args.steps}",
            f"train.eval_every={max(1, args.steps // 6)}",
            "checkpoint.every=0",
            "cluster.num_workers=1",
            "cluster.warm_pool=0",
            *args.set,
        ],
    )
    space = {k: parameter(k, v, base) for k, v in SPACE.items()}
    if not ray.is_initialized():
        ray.init(
            address="local", num_cpus=max(4, args.concurrency * 2), include_dashboard=False, logging_level="warning"
        )
    base = override(base, {"data.source": resolve_data(base)})
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="etrain-bench-hpo-") as tmp:
        for seed in range(args.seeds):
            for name, (sampler, pruning) in VARIANTS.items():
                started = time.perf_counter()
                rows = run_search(
                    base,
                    space,
                    args.trials,
                    Path(tmp) / f"{name}-{seed}",
                    train,
                    concurrency=args.concurrency,
                    seed=seed,
                    sampler=sampler,
                    pruning=pruning,
                    progress=False,
                )
                done = [r for r in rows if r["status"] == "completed"]
                run = {
                    "seed": seed,
                    "best_eval_loss": min(r["eval_loss"] for r in done),
                    "trial_steps": sum(r["steps"] for r in rows),
                    "completed": len(done),
                    "pruned": sum(r["status"] == "pruned" for r in rows),
                    "failed": sum(r["status"] == "failed" for r in rows),
                    "wall_s": time.perf_counter() - started,
                }
                runs[name].append(run)
                print(
                    f"seed {seed} {name:>15}: "
                    f"{json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in run.items()})}",
                    flush=True,
                )
    mean = {
        name: {
            "best_eval_loss": statistics.mean(r["best_eval_loss"] for r in rs),
            "trial_steps": statistics.mean(r["trial_steps"] for r in rs),
        }
        for name, rs in runs.items()
    }
    tpe, rnd = ([r["best_eval_loss"] for r in runs[k]] for k in ("tpe", "random"))
    ratios = {
        "tpe_vs_random_mean_best_loss": mean["tpe"]["best_eval_loss"] / mean["random"]["best_eval_loss"],
        "random_minus_tpe_best_loss": statistics.mean(rnd) - statistics.mean(tpe),
        "random_minus_tpe_best_loss_95ci": bootstrap_difference(rnd, tpe),
        "tpe_wins_share_of_seeds": sum(t < r for t, r in zip(tpe, rnd)) / len(tpe),
        "asha_steps_saved": 1 - mean["tpe"]["trial_steps"] / mean["tpe_no_pruning"]["trial_steps"],
        "asha_best_loss_change": mean["tpe"]["best_eval_loss"] / mean["tpe_no_pruning"]["best_eval_loss"] - 1,
    }
    report = {
        "machine": "2 cores, tiny GPT (2 layers, width searched), 1 worker per trial",
        "trials": args.trials,
        "seeds": args.seeds,
        "steps": args.steps,
        "concurrency": args.concurrency,
        "space": SPACE,
        "runs": runs,
        "mean": mean,
        "ratios": ratios,
    }
    print(json.dumps(ratios, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
