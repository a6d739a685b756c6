"""`etrain tune`: a Bayesian hyper-parameter search (Ray Tune, Optuna TPE, ASHA) over real training runs
(etrain/tune/), started or resumed in its --out directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from etrain.cli.options import add_config, command


def add_command(sub) -> None:
    p = command(
        sub,
        "tune",
        cmd_tune,
        "Bayesian hyper-parameter search (Ray Tune, Optuna TPE, ASHA) over real training runs",
        "etrain tune --config tiny --space space.yaml --trials 24 --concurrency 2 --out tune/",
        "etrain tune --resume --out tune/",
    )
    add_config(p)
    p.add_argument("--space", help="YAML: config keys and their distributions (loguniform, uniform, int, choice)")
    p.add_argument("--trials", type=int, default=20, help="trials to run")
    p.add_argument("--concurrency", type=int, default=1, help="trials at once (each takes cluster.num_workers workers)")
    p.add_argument("--out", default="tune", help="the search's directory: study, trials' runs, trials.json, best.yaml")
    p.add_argument(
        "--seed", type=int, default=0, help="the sampler's seed (with --concurrency 1 a search repeats exactly)"
    )
    p.add_argument("--sampler", choices=["tpe", "random"], default="tpe", help="TPE (multivariate) or random search")
    p.add_argument("--no-pruning", action="store_true", help="run every trial to the end (no ASHA)")
    p.add_argument(
        "--reduction",
        type=float,
        default=None,
        help="ASHA: 1/REDUCTION of the trials at each rung go on (default: tune.search's, measured in bench/hpo.py)",
    )
    p.add_argument(
        "--grace", type=int, default=None, help="ASHA: evaluations every trial gets before any is stopped (default too)"
    )
    p.add_argument(
        "--resume", action="store_true", help="continue the search in --out; finished trials are not run again"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_tune(args, started_at: float) -> int:
    from etrain.core.config import override
    from etrain.driver.job import connect, resolve_data, train
    from etrain.tune.search import GRACE, REDUCTION, check, format_table, run_search
    from etrain.tune.space import load_space

    _check_flags(args)
    out = Path(args.out)
    base, spec = _saved_search(out) if args.resume else _new_search(args)
    space = load_space(spec["space"], base)
    if not args.resume:
        _start(args, out, base, spec)
    check(out, args.resume, spec["pruning"], base)
    connect(base, jobs=spec["concurrency"])
    if base.data.source == "embedded":  # built once, not per trial
        base = override(base, {"data.source": resolve_data(base)})
    rows = run_search(
        base,
        space,
        spec["trials"],
        out,
        train,
        concurrency=spec["concurrency"],
        seed=spec["seed"],
        sampler=spec["sampler"],
        pruning=spec["pruning"],
        resume=args.resume,
        progress=not args.no_progress,
        reduction=spec.get("reduction", REDUCTION),
        grace=spec.get("grace", GRACE),
    )
    print(format_table(rows))
    print(f"trials: {out / 'trials.json'}", file=sys.stderr)
    if (out / "best.yaml").is_file():
        print(
            f"best config: {out / 'best.yaml'}  (train it: etrain train --config {out / 'best.yaml'})", file=sys.stderr
        )
    return 0


def _check_flags(args) -> None:
    from etrain.core.config import ConfigError

    if args.trials < 1 or args.concurrency < 1:
        raise ConfigError(f"--trials and --concurrency must be at least 1, got {args.trials} and {args.concurrency}")
    if args.resume and (args.reduction is not None or args.grace is not None):
        raise ConfigError(
            "--reduction and --grace are fixed when a search starts (its study holds the scheduler): a resumed "
            "search keeps its own; leave them out, or start a new search with another --out"
        )
    if args.reduction is not None and args.reduction <= 1 or args.grace is not None and args.grace < 1:
        raise ConfigError(f"--reduction must be above 1 and --grace at least 1, got {args.reduction} and {args.grace}")


def _saved_search(out: Path) -> tuple:
    """The base config and the spec (search.json) of the search in `out`, to resume it."""
    from etrain.core.config import ConfigError, load_config

    saved = out / "search.json"
    if not saved.is_file():
        raise ConfigError(f"no search to resume under {out} (no search.json); start one without --resume")
    spec = json.loads(saved.read_text())
    return load_config(str(out / "base.yaml")), spec


def _new_search(args) -> tuple:
    """A new search's base config and spec, from the flags."""
    from etrain.core.config import ConfigError, load_config
    from etrain.tune.search import GRACE, REDUCTION

    if not args.space:
        raise ConfigError(
            "--space SPACE.yaml is required (config keys and their distributions; see etrain/tune/space.py)"
        )
    base = load_config(args.config, args.set)
    spec = {
        "space": str(Path(args.space).resolve()),
        "trials": args.trials,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "sampler": args.sampler,
        "pruning": not args.no_pruning,
        "reduction": args.reduction or REDUCTION,
        "grace": args.grace or GRACE,
    }
    return base, spec


def _start(args, out: Path, base, spec: dict) -> None:
    """A new search's directory, with its base config and spec, once ASHA would stop something and `out` holds no
    other search."""
    from etrain.core.config import ConfigError

    if args.grace and spec["pruning"] and args.grace * base.train.eval_every >= base.train.steps:
        raise ConfigError(
            f"--grace {args.grace} evaluations of train.eval_every={base.train.eval_every} steps reach "
            f"train.steps={base.train.steps}: ASHA would stop nothing; lower --grace or pass --no-pruning"
        )
    if (out / "study").exists():
        raise ConfigError(f"{out} already holds a search; continue it with --resume, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "base.yaml").write_text(base.to_yaml())
    (out / "search.json").write_text(json.dumps(spec, indent=1) + "\n")
