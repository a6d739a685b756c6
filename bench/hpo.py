"""Hyper-parameter search at an equal budget of trials, side by side in one Ray instance.

TPE (Optuna, multivariate) vs random search, both with ASHA, over the same space and
the same number of trials for each of several search seeds: each search's best eval loss,
the mean difference with a bootstrap 95% interval, and the share of seeds TPE wins.
And ASHA vs no pruning (both TPE): total training steps spent, and the best loss.
Every trial trains the tiny GPT with one worker. The space is one where parameters
interact: the best lr depends on the width and on the warm-up, weight decay on the lr.

    python bench/hpo.py [--trials 48] [--seeds 5] [--steps 60] [--variants tpe random ...] [--resume]
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
MACHINE = "2 cores, tiny GPT (2 layers, width searched), 1 worker per trial"
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
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--resume", action="store_true", help="keep the searches --out holds; run the seeds it lacks")
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
    config = {"trials": args.trials, "steps": args.steps, "concurrency": args.concurrency, "space": SPACE}
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    if args.resume:
        runs = resumed(Path(args.out), config)
    report = {"machine": MACHINE, **config, "runs": runs, **summarize(runs)}
    with tempfile.TemporaryDirectory(prefix="etrain-bench-hpo-") as tmp:
        for seed in range(args.seeds):
            for name, (sampler, pruning) in VARIANTS.items():
                if name not in args.variants or any(r["seed"] == seed for r in runs[name]):
                    continue
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
                if len(rows) < args.trials:  # Tune ends a search early on Ctrl-C: its best would be a lesser one
                    raise SystemExit(f"{name}, seed {seed}: {len(rows)} of {args.trials} trials ran; not recorded")
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
                report = {"machine": MACHINE, **config, "runs": runs, **summarize(runs)}
                if args.out:  # after every search: a long benchmark killed part-way keeps what it measured
                    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report.get("ratios"), indent=1))
    return report


def resumed(out: Path, config: dict) -> dict[str, list[dict]]:
    """The searches an earlier run of the same benchmark saved in `out`, to go on from."""
    earlier = json.loads(out.read_text())
    differs = [k for k, v in config.items() if k != "concurrency" and earlier.get(k) != v]
    if differs:
        raise SystemExit(f"--resume: {out} was measured with other {', '.join(differs)}; start it afresh")
    return {name: earlier["runs"].get(name, []) for name in VARIANTS}


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Each comparison over the seeds both of its sides have run (at least 2)."""
    out: dict = {"mean": {}, "ratios": {}}
    tpe, rnd = paired(runs, "tpe", "random")
    if len(tpe) >= 2:
        a, b = [r["best_eval_loss"] for r in tpe], [r["best_eval_loss"] for r in rnd]
        out["mean"] |= {"tpe": means(tpe), "random": means(rnd)}
        out["ratios"] |= {
            "tpe_vs_random_seeds": [r["seed"] for r in tpe],
            "tpe_vs_random_mean_best_loss": statistics.mean(a) / statistics.mean(b),
            "random_minus_tpe_best_loss": statistics.mean(b) - statistics.mean(a),
            "random_minus_tpe_best_loss_95ci": bootstrap_difference(b, a),
            "tpe_wins_share_of_seeds": sum(x < y for x, y in zip(a, b)) / len(a),
        }
    asha, full = paired(runs, "tpe", "tpe_no_pruning")
    if len(asha) >= 2:
        m_asha, m_full = means(asha), means(full)
        out["mean"] |= {"tpe_no_pruning": m_full}
        out["ratios"] |= {
            "asha_seeds": [r["seed"] for r in asha],
            "asha_steps_saved": 1 - m_asha["trial_steps"] / m_full["trial_steps"],
            "asha_best_loss_change": m_asha["best_eval_loss"] / m_full["best_eval_loss"] - 1,
        }
    return out


def paired(runs: dict[str, list[dict]], a: str, b: str) -> tuple[list[dict], list[dict]]:
    """The runs of `a` and `b` on the seeds both have, in seed order."""
    seeds = {r["seed"] for r in runs[a]} & {r["seed"] for r in runs[b]}
    return tuple(sorted((r for r in runs[k] if r["seed"] in seeds), key=lambda r: r["seed"]) for k in (a, b))


def means(rs: list[dict]) -> dict:
    return {k: statistics.mean(r[k] for r in rs) for k in ("best_eval_loss", "trial_steps")}


if __name__ == "__main__":
    main()
