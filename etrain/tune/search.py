"""Bayesian hyper-parameter search over real training runs: Ray Tune, Optuna's TPE, ASHA.

Every trial is a job of this project (etrain/driver/job.py `train`) in the trial's own placement
group: a bundle for the coordinator and one per worker, so concurrent trials never take
each other's CPUs. A trial reports its eval loss at each evaluation, which is what ASHA
prunes on (its time axis is the training step). The study lives in `OUT/study` (Tune's
experiment state, with the Optuna sampler pickled inside), each trial's run directory in
`OUT/trials/ID`: an interrupted search resumes with `--resume`, finished trials are not
run again, and a trial that was running continues from its own last checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import optuna
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search.optuna import OptunaSearch
from tqdm.auto import tqdm  # a widget in a notebook

from etrain.core import checkpoint
from etrain.core.config import Config, ConfigError, override
from etrain.core.errors import why
from etrain.core.records import read_jsonl

METRIC = "eval_loss"
# ASHA's defaults, chosen from the trade-off curve bench/hpo.py measures (bench/README.md, "HPO"): trials go on
# past GRACE evaluations before any is stopped, and 1/REDUCTION of them go on at each rung.
REDUCTION = 2
GRACE = 1


def run_search(
    base: Config,
    space: dict,
    trials: int,
    out: Path,
    train: Callable[..., dict],
    concurrency: int = 1,
    seed: int = 0,
    sampler: str = "tpe",
    pruning: bool = True,
    resume: bool = False,
    max_failures: int = 1,
    progress: bool = True,
    reduction: float = REDUCTION,
    grace: int = GRACE,
    reuse: bool = False,
) -> list[dict]:
    """Run (or resume) a search of `train` (etrain.driver.job.train: one training run) over `space`; the trials' rows,
    best first. Writes OUT/trials.json and OUT/best.yaml. Ray is connected, and base's data ready, by the caller.
    `reuse`: a trial's process runs the next trial (a `train` that trains in the trial's own process)."""
    out = Path(out).expanduser().resolve()  # Tune runs each trial in its own working directory
    check(out, resume, pruning, base)
    study = out / "study"
    trainable = tune.with_parameters(_trial, base=base.model_dump(), root=str(out / "trials"), train=train)
    trainable = tune.with_resources(trainable, _resources(base))
    if resume:
        tuner = tune.Tuner.restore(
            str(study), trainable, resume_unfinished=True, resume_errored=False, restart_errored=False
        )
    else:
        tuner = tune.Tuner(
            trainable,
            tune_config=_tune_config(
                base,
                space,
                trials,
                concurrency,
                seed,
                sampler,
                asha(base, reduction, grace) if pruning else None,
                reuse,
            ),
            run_config=tune.RunConfig(
                name="study",
                storage_path=str(out),
                verbose=0,
                callbacks=[Progress(trials, base.train.steps, progress)],
                failure_config=tune.FailureConfig(max_failures=max_failures),
            ),
        )
    grid = tuner.fit()
    rows = table(grid, list(space), base.train.steps, out / "trials")
    (out / "trials.json").write_text(json.dumps(rows, indent=1) + "\n")
    best = next((r for r in rows if r["status"] == "completed"), None)
    if best is not None:
        (out / "best.yaml").write_text(override(base, {**best["params"], "run.name": None}).to_yaml())
    return rows


def check(out: Path, resume: bool, pruning: bool, base: Config) -> None:
    """What a search needs, checked before Ray starts: a study to resume (one we can trust), or none in the way."""
    study = Path(out) / "study"
    if resume and not tune.Tuner.can_restore(str(study)):
        raise ConfigError(f"no search to resume under {out} (no {study}/tuner.pkl); start one without --resume")
    if resume:
        check_trusted(Path(out))
    if not resume and study.exists():
        raise ConfigError(f"{out} already holds a search; continue it with --resume, or choose another --out")
    if pruning and base.train.eval_every == 0:
        raise ConfigError(
            "early stopping (ASHA) judges trials by their evaluations: set train.eval_every > 0, or pass --no-pruning"
        )


def check_trusted(out: Path) -> None:
    """Resuming unpickles the study (Ray Tune's design: tuner.pkl, the searcher's state), and a pickle runs
    code. Refuse a search directory, study or pickle that another user owns or that anyone may write."""
    for path in [out, out / "study", *sorted((out / "study").rglob("*.pkl"))]:
        st = path.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o002:
            who = f"owned by uid {st.st_uid}" if st.st_uid != os.getuid() else "writable by anyone"
            raise ConfigError(
                f"{path} is {who}: resuming a search unpickles its study, which runs code from these files; "
                f"resume only a search directory that you wrote and others cannot write (chmod o-w), or start a new one"
            )


def asha(base: Config, reduction: float = REDUCTION, grace: int = GRACE) -> ASHAScheduler:
    """ASHA on the training step: no trial stopped before `grace` evaluations (fewer where the run has fewer before
    its last), 1/`reduction` going on at each rung."""
    steps, every = base.train.steps, base.train.eval_every
    return ASHAScheduler(
        time_attr="step",
        metric=METRIC,
        mode="min",
        max_t=steps,
        grace_period=grace * every if grace * every < steps else every * ((steps - 1) // every) or steps,
        reduction_factor=reduction,
        stop_last_trials=False,
    )


def _tune_config(
    base: Config,
    space: dict,
    trials: int,
    concurrency: int,
    seed: int,
    sampler: str,
    scheduler: ASHAScheduler | None,
    reuse: bool,
) -> tune.TuneConfig:
    samplers = {
        "tpe": lambda: optuna.samplers.TPESampler(multivariate=True, seed=seed),
        "random": lambda: optuna.samplers.RandomSampler(seed=seed),
    }
    # OptunaSearch needs metric and mode itself when given a space: without them it maximises.
    search = Search(space, metric=METRIC, mode="min", sampler=samplers[sampler](), steps=base.train.steps)
    return tune.TuneConfig(
        search_alg=search,
        scheduler=scheduler or FIFOScheduler(),
        num_samples=trials,
        max_concurrent_trials=concurrency,
        reuse_actors=reuse,
    )


class Search(OptunaSearch):
    """Ray's OptunaSearch, telling Optuna that a trial ASHA stopped was pruned.

    Ray tells Optuna every trial that ends with a result as COMPLETE, valued at its last result, so a
    trial stopped at its first rung would stand beside finished ones with an early, worse loss. Optuna
    has the trial's evaluations already (Ray reports each one as an intermediate value), and its TPE
    ranks a PRUNED trial by them, below every finished trial that got further.
    """

    def __init__(self, *args, steps: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = steps

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
        stopped = not error and result is not None and result.get("step", self.steps) < self.steps
        # Ray's own rule: no result and no error is PRUNED
        super().on_trial_complete(trial_id, None if stopped else result, error)


def _resources(base: Config) -> tune.PlacementGroupFactory:
    """The trial's driver and coordinator take no CPU to speak of; each worker its own bundle."""
    c = base.cluster
    worker = {"CPU": c.cpus_per_worker} | ({"GPU": c.gpus_per_worker} if c.gpus_per_worker else {})
    return tune.PlacementGroupFactory([{"CPU": 0.01}] + [worker] * c.num_workers, strategy="PACK")


def _trial(params: dict, base: dict, root: str, train: Callable[..., dict]) -> None:
    """One training run with the trial's parameters; reports each evaluation. A retried or resumed
    trial continues from its run's last checkpoint."""
    trial_id = tune.get_context().get_trial_id()
    run_dir = Path(root) / trial_id
    fixed = {
        "run.root": root,
        "run.name": trial_id,
        "cluster.warm_pool": 0,
        "cluster.max_workers": None,
        "checkpoint.uri": None,
    }
    cfg = override(Config.model_validate(base), {**params, **fixed})
    resume = run_dir.exists() and checkpoint.newest_meta(str(run_dir / "checkpoints")) is not None
    if run_dir.exists() and not resume:
        shutil.rmtree(run_dir)  # died before its first checkpoint: start it over
    if not resume:
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        (run_dir / "params.json").write_text(json.dumps(params))  # the table's source for a trial that never reported
    reported = []

    def report(e: dict) -> None:
        tune.report({METRIC: float(e["eval_loss"]), "step": int(e["step"])})
        reported.append(e["step"])

    # a retried trial whose checkpoints all fail verification starts over (its resume record names them)
    train(cfg, run_dir, resume=resume, progress=False, on_eval=report, restart_if_corrupt=True)
    if not reported:  # resumed after its last evaluation (killed while finishing): report that one
        evals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
        if evals:
            report(evals[-1])


def table(grid, keys: list[str], steps: int, runs: Path) -> list[dict]:
    """Every trial: id, parameters, last eval loss, steps reached, status (completed, pruned, failed); best first."""
    rows = []
    for result in grid:
        metrics = result.metrics or {}
        reached = metrics.get("step", 0)
        status = "failed" if result.error else "completed" if reached >= steps else "pruned"
        trial = metrics.get("trial_id") or _name_part(result.path, 2)
        config = result.config or {}
        if not config and (runs / str(trial) / "params.json").is_file():  # failed before its first report
            config = json.loads((runs / str(trial) / "params.json").read_text())
        params = {k: config.get(k) for k in keys}
        number = _name_part(result.path, 3)
        rows.append(
            {
                "trial": trial,
                "number": int(number) if number and number.isdigit() else None,
                "params": params,
                METRIC: metrics.get(METRIC),
                "steps": reached,
                "status": status,
                "error": why(result.error) if result.error else None,
            }
        )
    order = {"completed": 0, "pruned": 1, "failed": 2}
    return sorted(rows, key=lambda r: (order[r["status"]], r[METRIC] if r[METRIC] is not None else float("inf")))


def _name_part(path: str | None, index: int) -> str | None:
    """Tune names a trial's directory _trial_ID_NUMBER_params_date: 2 is the id, 3 the position in the search."""
    parts = Path(path).name.split("_") if path else []
    return parts[index] if len(parts) > index else None


def format_table(rows: list[dict]) -> str:
    keys = list(rows[0]["params"]) if rows else []
    header = ["trial", *keys, METRIC, "steps", "status"]
    body = [
        [r["trial"] or "?", *(_fmt(r["params"][k]) for k in keys), _fmt(r[METRIC]), str(r["steps"]), r["status"]]
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in [header, *body])


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else "-" if value is None else str(value)


class Progress(tune.Callback):
    """Trials done, running and pruned, with the best eval loss so far. Tune pickles it with the
    study, and a resumed search gets it back from there: the bar is drawn anew, counts kept."""

    def __init__(self, trials: int, steps: int, enabled: bool = True):
        self.trials, self.steps, self.enabled = trials, steps, enabled
        self.running: set[str] = set()
        self.done = self.pruned = self.failed = 0
        self.best: float | None = None
        self.bar = None

    def on_trial_start(self, iteration, trials, trial, **info):
        self.running.add(trial.trial_id)
        self._show()

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if METRIC in result:
            self.best = min(self.best, result[METRIC]) if self.best is not None else result[METRIC]
        if result.get("done") and result.get("step", self.steps) < self.steps:  # ASHA stopped it
            self.pruned += 1
        self._show()

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._finish(trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        self.failed += 1
        self._finish(trial)

    def on_experiment_end(self, trials, **info):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _finish(self, trial) -> None:
        self.running.discard(trial.trial_id)
        self.done += 1
        self._show(advance=1)

    def _show(self, advance: int = 0) -> None:
        if self.bar is None:
            self.bar = tqdm(
                total=self.trials,
                initial=self.done - advance,
                unit="trial",
                desc="search",
                disable=not self.enabled,
                dynamic_ncols=True,
            )
        self.bar.update(advance)
        best = f"{self.best:.4f}" if self.best is not None else "-"
        self.bar.set_postfix(running=len(self.running), pruned=self.pruned, failed=self.failed, best=best)

    def __getstate__(self):
        return {**self.__dict__, "bar": None}
