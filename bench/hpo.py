"""Hyper-parameter search at an equal budget of trials, side by side in one Ray instance.

Three searches for each search seed, over the same space and number of trials: TPE (Optuna, multivariate) and
random search, both with ASHA at `tune.search`'s defaults, and random search without pruning. From them:

- TPE against random: each search's best eval loss, the mean difference with a bootstrap 95% interval, and
  trials-to-reach, the trials TPE needs to reach random search's final best at the same seed (and the other way
  round), median with a bootstrap 95% interval; a search that never reaches it counts as trials + 1.
- ASHA's trade-off curve: the unpruned searches replayed through Ray's own ASHAScheduler at each reduction
  factor and grace period (trials in proposal order, `--concurrency` at a time, each evaluation an event at its
  step): trial steps saved against the best eval loss lost. Random search proposes the same trials whatever
  was pruned, so a replay is the search ASHA would have run, up to the order of simultaneous events; the live
  random+ASHA searches check that on the default. `asha_choice` is the setting that saves the most steps while
  no seed's best loss is more than 2% above its unpruned best; tune.search's defaults (REDUCTION, GRACE) are set
  to it.

The objective is the tiny GPT's training (2 layers, width searched, batch 8) on the embedded corpus, 60 steps,
an evaluation every 10. `--objective process` (the default) trains it in the trial's own process (our model,
optimizer, schedule and sample order in plain torch, one thread, the process reused by the next trial): what
this measures is the search, and a real job's start-up (three processes, each importing torch) would take
longer than its training. `--objective job` runs each trial as a real job (etrain.driver.job), as `etrain tune` does.

    python bench/hpo.py [--trials 48] [--seeds 10] [--steps 60] [--variants ...] [--objective process] [--resume]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import ray

from etrain.core.config import load_config, override
from etrain.core.records import read_jsonl
from etrain.driver.job import resolve_data, train
from etrain.tune.search import GRACE, REDUCTION, asha, run_search

RESULTS = Path(__file__).resolve().parent / "results"
SPACE = {
    "optim.lr": {"loguniform": [1.0e-4, 3.0e-2]},
    "optim.warmup_steps": {"int": [0, 30]},
    "optim.weight_decay": {"uniform": [0.0, 0.3]},
    "optim.beta2": {"uniform": [0.9, 0.999]},
    "model.d_model": {"choice": [64, 96, 128, 160]},
}
MACHINE = "2 cores, tiny GPT (2 layers, width searched), batch 8 x 128 tokens, one thread or worker per trial"
VARIANTS = {"tpe": ("tpe", True), "random": ("random", True), "random_no_pruning": ("random", False)}
REDUCTIONS = (2, 3, 4, 6)  # the trade-off curve's reduction factors ...
GRACES = (1, 2, 3, 4)  # ... and grace periods, in evaluations
LOSS_BOUND = 0.02  # the choice: the setting that saves the most steps with every seed's best-loss change within this


def train_in_process(cfg, run_dir: Path, resume: bool = False, progress: bool = False, on_eval=None) -> dict:
    """One trial's training in this process: our model, AdamW, schedule and global sample order, evaluated on the
    run's held-out samples every `train.eval_every` steps and after the last, as a job does; writes the eval
    records to RUN_DIR/metrics.jsonl."""
    import torch

    from etrain.core.models import make_model
    from etrain.core.optim import make_optimizer, make_scheduler
    from etrain.data import order
    from etrain.data.shards import ShardReader, read_manifest

    if resume:
        raise ValueError("a trial trained in process keeps no checkpoints: it cannot resume")
    torch.set_num_threads(1)
    torch.manual_seed(cfg.train.seed)
    splits = read_manifest(cfg.data.source)["splits"]
    reader, held_out = ShardReader(cfg.data.source, "train"), ShardReader(cfg.data.source, "eval")
    layout = order.Layout(
        cfg.train.seed, tuple(s["samples"] for s in splits["train"]["shards"]), cfg.data.shuffle_shards
    )
    num_eval = splits["eval"]["samples"]
    eval_ids = order.take(order.Layout(0, (num_eval,), 1), 0, min(cfg.train.eval_samples, num_eval))
    eval_rows = torch.from_numpy(held_out.get(eval_ids).astype(np.int64))
    model = make_model(cfg.model)
    optimizer = make_optimizer(model, cfg.optim)
    scheduler = make_scheduler(optimizer, cfg.optim, cfg.train.steps)
    gb, every, steps = cfg.train.global_batch, cfg.train.eval_every, cfg.train.steps
    with open(Path(run_dir) / "metrics.jsonl", "a") as records:
        for step in range(1, steps + 1):
            rows = torch.from_numpy(reader.get(order.take(layout, (step - 1) * gb, gb)).astype(np.int64))
            optimizer.zero_grad(set_to_none=True)
            model(rows[:, :-1], rows[:, 1:])[1].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or math.inf)  # 0: no clipping
            optimizer.step()
            scheduler.step()
            if step == steps or (every > 0 and step % every == 0):
                with torch.no_grad():
                    chunks = eval_rows.split(cfg.train.micro_batch)
                    total = sum(model(c[:, :-1], c[:, 1:])[1].item() * len(c) for c in chunks)
                record = {"kind": "eval", "step": step, "eval_loss": total / len(eval_rows)}
                records.write(json.dumps(record) + "\n")
                records.flush()
                if on_eval is not None:
                    on_eval(record)
    return {"eval_loss": record["eval_loss"]}


OBJECTIVES = {"process": train_in_process, "job": train}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=48)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60, help="training steps per trial")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--objective", choices=list(OBJECTIVES), default="process")
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
    from etrain.tune.space import parameter

    base = load_config(
        "tiny",
        [
            f"data.cache_dir={args.data}",
            f"train.steps={args.steps}",
            f"train.eval_every={max(1, args.steps // 6)}",
            "checkpoint.every=0",
            "cluster.num_workers=1",
            "cluster.warm_pool=0",
            "train.global_batch=8",
            "train.micro_batch=8",
            *args.set,
        ],
    )
    space = {k: parameter(k, v, base) for k, v in SPACE.items()}
    if not ray.is_initialized():
        ray.init(
            address="local", num_cpus=max(4, args.concurrency * 2), include_dashboard=False, logging_level="warning"
        )
    base = override(base, {"data.source": resolve_data(base)})
    config = {
        "trials": args.trials,
        "steps": args.steps,
        "concurrency": args.concurrency,
        "objective": args.objective,
        "space": SPACE,
    }
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    if args.resume:
        runs = resumed(Path(args.out), config)
    publish = Published(args.out, config, base)
    with tempfile.TemporaryDirectory(prefix="etrain-bench-hpo-") as tmp:
        for seed in range(args.seeds):
            for name, (sampler, pruning) in VARIANTS.items():
                if name not in args.variants or any(r["seed"] == seed for r in runs[name]):
                    continue
                out = Path(tmp) / f"{name}-{seed}"
                started = time.perf_counter()
                rows = run_search(
                    base,
                    space,
                    args.trials,
                    out,
                    OBJECTIVES[args.objective],
                    concurrency=args.concurrency,
                    seed=seed,
                    sampler=sampler,
                    pruning=pruning,
                    progress=False,
                    reuse=args.objective == "process",
                )
                if len(rows) < args.trials:  # Tune ends a search early on Ctrl-C: its best would be a lesser one
                    raise SystemExit(f"{name}, seed {seed}: {len(rows)} of {args.trials} trials ran; not recorded")
                run = search_record(rows, out / "trials", seed, time.perf_counter() - started)
                run |= {"reduction": REDUCTION, "grace": GRACE} if pruning else {}
                runs[name].append(run)
                shown = {k: v for k, v in run.items() if k != "trials"}
                print(f"seed {seed} {name:>17}: {json.dumps(shown)}", flush=True)
                publish(runs)  # after every search: a long benchmark killed part-way keeps what it measured
    report = publish(runs)
    print(json.dumps(report.get("ratios"), indent=1))
    return report


def search_record(rows: list[dict], trials: Path, seed: int, wall_s: float) -> dict:
    """What a search did: its best, the steps it spent, and each trial in proposal order with its evaluations."""
    done = [r for r in rows if r["status"] == "completed"]
    return {
        "seed": seed,
        "best_eval_loss": min(r["eval_loss"] for r in done),
        "trial_steps": sum(r["steps"] for r in rows),
        "completed": len(done),
        "pruned": sum(r["status"] == "pruned" for r in rows),
        "failed": sum(r["status"] == "failed" for r in rows),
        "wall_s": round(wall_s, 1),
        "trials": [
            {
                "number": r["number"],
                "status": r["status"],
                "evals": [
                    [e["step"], e["eval_loss"]]
                    for e in read_jsonl(trials / r["trial"] / "metrics.jsonl")
                    if e["kind"] == "eval"
                ]
                if (trials / r["trial"] / "metrics.jsonl").is_file()
                else [],
            }
            for r in sorted(rows, key=lambda r: r["number"])
        ],
    }


class Published:
    """The report from the searches so far, written to `out` (unless '') each time it is called."""

    def __init__(self, out: str, config: dict, base):
        self.out, self.config, self.base = out, config, base

    def __call__(self, runs: dict[str, list[dict]]) -> dict:
        report = {"machine": MACHINE, **self.config, "runs": runs, **summarize(runs, self.base, self.config)}
        if self.out:
            Path(self.out).write_text(json.dumps(report, indent=1) + "\n")
            plot(report, Path(self.out).with_suffix(".png"))
        return report


def resumed(out: Path, config: dict) -> dict[str, list[dict]]:
    """The searches an earlier run of the same benchmark saved in `out`, to go on from."""
    earlier = json.loads(out.read_text())
    differs = [k for k, v in config.items() if k != "concurrency" and earlier.get(k) != v]
    if differs:
        raise SystemExit(f"--resume: {out} was measured with other {', '.join(differs)}; start it afresh")
    return {name: earlier["runs"].get(name, []) for name in VARIANTS}


# -- the figures ----------------------------------------------------------------


def summarize(runs: dict[str, list[dict]], base, config: dict) -> dict:
    """Each comparison over the seeds both of its sides have run (at least 2)."""
    out: dict = {"mean": {}, "ratios": {}}
    tpe, rnd = paired(runs, "tpe", "random")
    if len(tpe) >= 2:
        a, b = [r["best_eval_loss"] for r in tpe], [r["best_eval_loss"] for r in rnd]
        tpe_reach = [trials_to_reach(t, r["best_eval_loss"]) for t, r in zip(tpe, rnd)]
        random_reach = [trials_to_reach(r, t["best_eval_loss"]) for t, r in zip(tpe, rnd)]
        out["mean"] |= {"tpe": means(tpe), "random": means(rnd)}
        out["ratios"] |= {
            "tpe_vs_random_seeds": [r["seed"] for r in tpe],
            "tpe_vs_random_mean_best_loss": statistics.mean(a) / statistics.mean(b),
            "random_minus_tpe_best_loss": statistics.mean(b) - statistics.mean(a),
            "random_minus_tpe_best_loss_95ci": bootstrap_difference(b, a),
            "tpe_wins_share_of_seeds": sum(x < y for x, y in zip(a, b)) / len(a),
            "tpe_trials_to_reach_random": tpe_reach,
            "tpe_trials_to_reach_random_median": statistics.median(tpe_reach),
            "tpe_trials_to_reach_random_median_95ci": bootstrap_median(tpe_reach),
            "random_trials_to_reach_tpe": random_reach,
            "random_trials_to_reach_tpe_median": statistics.median(random_reach),
            "random_trials_to_reach_tpe_median_95ci": bootstrap_median(random_reach),
        }
    full = sorted(runs["random_no_pruning"], key=lambda r: r["seed"])
    if len(full) >= 2:
        curve = tradeoff(full, base, config["concurrency"])
        out["asha_tradeoff"] = curve
        within = [c for c in curve if c["best_loss_change_worst"] <= LOSS_BOUND] or curve
        choice = max(within, key=lambda c: (c["steps_saved"], -c["best_loss_change"]))
        out["ratios"] |= {"asha_choice": {k: choice[k] for k in ("reduction", "grace")}}
        default = next(c for c in curve if c["reduction"] == REDUCTION and c["grace"] == GRACE)
        out["ratios"] |= {"asha_default": {"reduction": REDUCTION, "grace": GRACE} | default}
        live, unpruned = paired(runs, "random", "random_no_pruning")
        if len(live) >= 2:  # the replay held to the live searches at the default
            out["ratios"] |= {
                "asha_live_seeds": [r["seed"] for r in live],
                "asha_live_steps_saved": 1
                - sum(r["trial_steps"] for r in live) / sum(r["trial_steps"] for r in unpruned),
                "asha_live_best_loss_change": statistics.mean(
                    p["best_eval_loss"] / f["best_eval_loss"] - 1 for p, f in zip(live, unpruned)
                ),
            }
    return out


def trials_to_reach(search: dict, target: float) -> int:
    """The trials (in proposal order) after which `search` has completed one at or below `target`; trials + 1 if
    none did."""
    for i, trial in enumerate(search["trials"], 1):
        if trial["status"] == "completed" and trial["evals"] and trial["evals"][-1][1] <= target:
            return i
    return len(search["trials"]) + 1


def replay(search: dict, base, reduction: float, grace: int, concurrency: int) -> dict:
    """An unpruned search's trials through Ray's ASHAScheduler (the one `etrain tune` uses, tune.search.asha): trial
    steps spent and the best eval loss of the trials it let finish. Trials start in proposal order, `concurrency`
    at a time; each evaluation is an event at (its trial's start + its step), taken in time order (ties: the
    earlier trial)."""
    scheduler = asha(base, reduction, grace)
    steps = base.train.steps
    pending = list(search["trials"])
    running: list[tuple[int, int, dict, int]] = []  # (start, number, trial, index of its next evaluation)
    clock, spent, best = 0, 0, float("inf")

    def start(at: int) -> None:
        trial = pending.pop(0)
        scheduler.on_trial_add(None, SimpleNamespace(trial_id=str(trial["number"])))
        running.append((at, trial["number"], trial, 0))

    while pending and len(running) < concurrency:
        start(0)
    while running:
        running.sort(key=lambda r: (r[0] + r[2]["evals"][r[3]][0], r[1]))
        at, number, trial, i = running.pop(0)
        step, loss = trial["evals"][i]
        clock = at + step
        result = {"step": step, "eval_loss": loss}
        stop = scheduler.on_trial_result(None, SimpleNamespace(trial_id=str(number)), result) == "STOP"
        if step >= steps or stop or i + 1 == len(trial["evals"]):
            spent += step
            if step >= steps:
                best = min(best, loss)
            if pending:
                start(clock)
        else:
            running.append((at, number, trial, i + 1))
    return {"trial_steps": spent, "best_eval_loss": best}


def tradeoff(full: list[dict], base, concurrency: int) -> list[dict]:
    """ASHA's steps saved and best-loss change against no pruning, for each reduction factor and grace period:
    means over the seeds (steps saved of the summed steps), and the worst seed's loss change."""
    curve = []
    for reduction in REDUCTIONS:
        for grace in GRACES:
            if grace * base.train.eval_every >= base.train.steps:
                continue
            pruned = [replay(s, base, reduction, grace, concurrency) for s in full]
            changes = [p["best_eval_loss"] / s["best_eval_loss"] - 1 for p, s in zip(pruned, full)]
            curve.append(
                {
                    "reduction": reduction,
                    "grace": grace,
                    "steps_saved": 1 - sum(p["trial_steps"] for p in pruned) / sum(s["trial_steps"] for s in full),
                    "best_loss_change": statistics.mean(changes),
                    "best_loss_change_worst": max(changes),
                }
            )
    return curve


def bootstrap_difference(a: list[float], b: list[float], resamples: int = 10_000) -> list[float]:
    """95% percentile interval of mean(a) - mean(b), each side resampled on its own (the seeds are not pairs)."""
    rng = np.random.default_rng(0)
    a_, b_ = np.asarray(a), np.asarray(b)
    diffs = rng.choice(a_, (resamples, a_.size)).mean(1) - rng.choice(b_, (resamples, b_.size)).mean(1)
    return [float(np.quantile(diffs, 0.025)), float(np.quantile(diffs, 0.975))]


def bootstrap_median(values: list[float], resamples: int = 10_000) -> list[float]:
    """95% percentile interval of the median of `values`."""
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(np.asarray(values), (resamples, len(values))), axis=1)
    return [float(np.quantile(medians, 0.025)), float(np.quantile(medians, 0.975))]


def paired(runs: dict[str, list[dict]], a: str, b: str) -> tuple[list[dict], list[dict]]:
    """The runs of `a` and `b` on the seeds both have, in seed order."""
    seeds = {r["seed"] for r in runs[a]} & {r["seed"] for r in runs[b]}
    return tuple(sorted((r for r in runs[k] if r["seed"] in seeds), key=lambda r: r["seed"]) for k in (a, b))


def means(rs: list[dict]) -> dict:
    return {k: statistics.mean(r[k] for r in rs) for k in ("best_eval_loss", "trial_steps")}


def plot(report: dict, path: Path) -> None:
    """ASHA's trade-off curve (steps saved against best loss lost, the default marked) and each search's running
    best over its trials."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for c in report.get("asha_tradeoff", []):
        x, colour = 100 * c["steps_saved"], "C3" if (c["reduction"], c["grace"]) == (REDUCTION, GRACE) else "C0"
        left.vlines(x, 100 * c["best_loss_change"], 100 * c["best_loss_change_worst"], colors=colour, alpha=0.5)
        left.scatter(x, 100 * c["best_loss_change"], c=colour)
        left.annotate(f"rf {c['reduction']}, grace {c['grace']}", (x, 100 * c["best_loss_change"]), fontsize=7)
    left.axhline(2, ls="--", c="grey")
    left.set(
        xlabel="trial steps saved (%)",
        ylabel="best eval loss vs no pruning (%)",
        title="ASHA replayed: mean over seeds, bar to the worst",
    )
    for name, colour in (("tpe", "C1"), ("random", "C0")):
        for i, run in enumerate(report["runs"].get(name, [])):
            best, line = float("inf"), []
            for t in run["trials"]:
                if t["status"] == "completed" and t["evals"]:
                    best = min(best, t["evals"][-1][1])
                line.append(best)
            right.plot(range(1, len(line) + 1), line, c=colour, alpha=0.4, label=name if i == 0 else None)
    right.set(xlabel="trials", ylabel="best eval loss so far", title="TPE and random search (ASHA)")
    if right.get_legend_handles_labels()[0]:
        right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
