"""`etrain`: the command line. Usage errors exit 2 with a message that says what to fix."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from actors.control import JobError, why
from app.config import RESUMABLE, Config, ConfigError, load_config
from app.job import durable, new_run_dir, train
from app.storage import StorageError
from pipelines.shards import ShardError


def main(argv: list[str] | None = None) -> int:
    """Every failure ends in one line on the terminal that names the cause and what to do: exit 2 for
    usage errors, 1 for runtime ones, 130 for Ctrl-C. A traceback goes to the log file the line names."""
    started_at = time.time()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    ours = not _ray_up()  # a Ray this command connects to is shut down by it (the caller's, as in tests, is not)
    try:
        return args.func(args, started_at)
    except (ConfigError, ShardError) as e:
        print(f"etrain: error: {e}", file=sys.stderr)
        return 2
    except JobError as e:
        print(f"etrain: training failed: {getattr(e, 'cause', e)}", file=sys.stderr)  # raised in an actor: not Ray's traceback
        return 1
    except StorageError as e:
        print(f"etrain: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"etrain: interrupted{getattr(args, 'resume_hint', '')}", file=sys.stderr)
        return 130
    except Exception as e:  # a failure nobody named: its one line here, the details in the log
        path = _log_traceback(e, getattr(args, "log_file", None))
        print(f"etrain: error: {why(e)}\n(details: {path})", file=sys.stderr)
        return 1
    finally:
        if ours and _ray_up():
            sys.modules["ray"].shutdown()  # before the interpreter exits: Ray's threads torn down mid-exit dump C++ stacks


def _ray_up() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def _log_traceback(error: BaseException, path: Path | None) -> Path:
    path = path or Path.home() / ".cache" / "etrain" / "logs" / f"etrain-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} etrain {' '.join(sys.argv[1:])}\n")
        traceback.print_exception(error, file=f)
    return path


def cmd_train(args, started_at: float) -> int:
    if args.resume and args.config:
        raise ConfigError("--resume takes the run's own config.yaml; drop --config (use --set for resumable keys)")
    if args.resume:
        run_dir = durable(Path(args.resume).expanduser().resolve(), "--resume")
        cfg = _resume_config(run_dir, args.set)
    else:
        cfg = load_config(args.config, args.set)
        run_dir = new_run_dir(cfg)
    args.log_file = run_dir / "driver.log"
    args.resume_hint = f"; resume with `etrain train --resume {run_dir}`"
    print(f"run directory: {run_dir}", file=sys.stderr)
    with _logging_to(args.log_file):
        summary = train(cfg, run_dir, resume=bool(args.resume), started_at=started_at, progress=not args.no_progress)
    print(json.dumps(summary, indent=1))
    print(f"metrics: {run_dir / 'metrics.jsonl'}\nsummary: {run_dir / 'summary.json'}", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _logging_to(path: Path):
    """The driver's log to `path` too, beside the terminal's lines."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


def cmd_prepare(args, started_at: float) -> int:
    from app.job import connect
    from pipelines.prepare import open_output, prepare

    sugar = [f"prepare.jsonl_field={args.field}"] * bool(args.field) + [f"prepare.parquet_column={args.column}"] * bool(args.column)
    cfg = load_config(args.config, [*sugar, *args.set])
    storage = dict(_parse_option(o) for o in args.storage_option)
    open_output(args.out, storage)  # a wrong option or an unreachable endpoint, named before Ray starts
    connect(cfg)
    report = prepare(args.src, args.out, cfg, overwrite=args.overwrite, storage=storage, progress=not args.no_progress)
    print(json.dumps(report, indent=1))
    out = args.out.rstrip("/")
    print(f"manifest: {out}/manifest.json\nreport: {out}/report.json\nquarantine: {out}/quarantine.jsonl", file=sys.stderr)
    print(f"train on it: etrain train --config {args.config or 'tiny'} --set data.source={out}/manifest.json", file=sys.stderr)
    return 0


def _parse_option(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--storage-option {item.split('=')[0]!r} must look like key=value (e.g. endpoint_url=http://127.0.0.1:9000)")
    return key, value


def cmd_scale(args, started_at: float) -> int:
    from app import api

    print(json.dumps(api.scale(args.run, args.workers)))
    return 0


def cmd_status(args, started_at: float) -> int:
    from app import api

    if args.every <= 0:
        raise ConfigError(f"--every must be positive, got {args.every}")
    if args.run is None:
        names = api.runs()
        print("\n".join(_status_line(api.status(n)) for n in names) if names else "no etrain job is running on this Ray cluster")
        return 0
    live, shown = not args.once and not args.json, False
    clear = "\033[H\033[J" if live and sys.stdout.isatty() else ""
    while True:
        try:
            st = api.status(args.run)
        except ConfigError:
            if not shown:
                raise
            print(f"{args.run}: the job has ended (its coordinator is gone); its records are in {Path(args.run) / 'metrics.jsonl'}")
            return 0
        print(clear + (json.dumps(st, indent=1) if args.json else _status_text(st)), flush=True)
        if not live:
            return 0
        shown = True
        time.sleep(args.every)


def _status_line(st: dict) -> str:
    loss = f"{st['loss']:.3f}" if st["loss"] is not None else "-"
    return f"{st['run']}: {st['phase']} step {st['step']}/{st['total_steps']} loss {loss} workers {st['world_size']} ETA {_duration(st['eta_s'])}"


def _status_text(st: dict) -> str:
    """What `etrain status RUN` shows: progress, model, throughput, membership, last checkpoint, members."""

    def num(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    done = st["step"] / st["total_steps"]
    ckpt = st["last_checkpoint"]
    lines = [
        f"run {st['run']}  ({st['run_dir']})",
        f"  {st['phase']:<13} step {st['step']}/{st['total_steps']} ({done:.0%})  elapsed {_duration(st['elapsed_s'])}  ETA {_duration(st['eta_s'])}",
        f"  loss {num(st['loss'], '.4f')}  eval loss {num(st['eval_loss'], '.4f')}  tokens/s {num(st['tokens_per_s'], ',.0f')}  MFU {num(st['mfu'], '.1%')}",
        f"  workers {st['world_size']} (wanted {st['wanted']}{', autoscaling' if st['autoscaling'] else ''})  warm pool {st['warm_pool_ready']} ready"
        f"  recoveries {st['recoveries']}  group generation {st['generation']}  sync {st['comm']}",
        "  last checkpoint: " + (f"step {ckpt['step']} ({ckpt['level']}) {ckpt['path']}" if ckpt else "none yet"),
    ]
    if st["draining_nodes"]:
        lines.append(f"  draining nodes (preemption notice): {', '.join(n[:8] for n in st['draining_nodes'])}")
    for m in st["members"]:
        speed = f"{m['speed']:.1f} samples/s" if m["speed"] else "speed not measured yet"
        lines.append(f"    rank {m['rank']}: node {(m['node'] or '?')[:8]} pid {m['pid']}  {speed}")
    return "\n".join(lines)


def _duration(seconds: float | None) -> str:
    from tqdm import tqdm

    return "-" if seconds is None else tqdm.format_interval(seconds)


def cmd_report(args, started_at: float) -> int:
    from app.report import write_report

    report = write_report(Path(args.run), Path(args.out) if args.out else None)
    print(json.dumps(report["summary"], indent=1))
    print(f"report: {report['html']}", file=sys.stderr)
    for name, path in report["plots"].items():
        print(f"{name}: {path}", file=sys.stderr)
    return 0


def cmd_spot_watch(args, started_at: float) -> int:
    from app.spot import watch

    print(json.dumps(watch(args.imds, args.node_id, args.every)))
    return 0


def cmd_tune(args, started_at: float) -> int:
    from tune.search import format_table, run_search
    from tune.space import load_space

    if args.trials < 1 or args.concurrency < 1:
        raise ConfigError(f"--trials and --concurrency must be at least 1, got {args.trials} and {args.concurrency}")
    out = Path(args.out)
    if args.resume:
        saved = out / "search.json"
        if not saved.is_file():
            raise ConfigError(f"no search to resume under {out} (no search.json); start one without --resume")
        spec = json.loads(saved.read_text())
        base, space_file = load_config(str(out / "base.yaml")), spec["space"]
    else:
        if not args.space:
            raise ConfigError("--space SPACE.yaml is required (config keys and their distributions; see tune/space.py)")
        base, space_file = load_config(args.config, args.set), str(Path(args.space).resolve())
        spec = {
            "space": space_file,
            "trials": args.trials,
            "concurrency": args.concurrency,
            "seed": args.seed,
            "sampler": args.sampler,
            "pruning": not args.no_pruning,
        }
    space = load_space(space_file, base)
    if not args.resume:
        if (out / "study").exists():
            raise ConfigError(f"{out} already holds a search; continue it with --resume, or choose another --out")
        out.mkdir(parents=True, exist_ok=True)
        (out / "base.yaml").write_text(base.to_yaml())
        (out / "search.json").write_text(json.dumps(spec, indent=1) + "\n")
    rows = run_search(
        base,
        space,
        spec["trials"],
        out,
        concurrency=spec["concurrency"],
        seed=spec["seed"],
        sampler=spec["sampler"],
        pruning=spec["pruning"],
        resume=args.resume,
        progress=not args.no_progress,
    )
    print(format_table(rows))
    print(f"trials: {out / 'trials.json'}", file=sys.stderr)
    if (out / "best.yaml").is_file():
        print(f"best config: {out / 'best.yaml'}  (train it: etrain train --config {out / 'best.yaml'})", file=sys.stderr)
    return 0


def cmd_config(args, started_at: float) -> int:
    cfg = load_config(args.config, args.set)
    print(cfg.to_yaml(), end="")
    need, here = cfg.worker_memory(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(
        f"model: {cfg.model.param_count():,} parameters; about {need / 2**30:,.2f} GiB per worker (weights, gradients, "
        f"AdamW state, activations of one micro-batch)",
        file=sys.stderr,
    )
    if need > here and not cfg.cluster.gpus_per_worker:
        print(f"warning: that is more than this machine's {here / 2**30:,.1f} GiB of memory", file=sys.stderr)
    return 0


def _resume_config(run_dir: Path, overrides: list[str]) -> Config:
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml); give the directory `etrain train` printed")
    for item in overrides:
        key = item.partition("=")[0].strip()
        if not any(key == k or key.startswith(k + ".") for k in RESUMABLE):
            raise ConfigError(f"--set {key} cannot change on resume (it changes what is trained); resumable: {', '.join(RESUMABLE)}")
    cfg = load_config(str(saved), overrides)
    if overrides:
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return cfg


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="etrain", description="Elastic transformer training on Ray.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", "-c", help="preset name in configs/ (tiny, small, ...) or a YAML file")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. train.steps=100")

    p = sub.add_parser("train", help="train a model (a new run, or --resume RUN_DIR)")
    with_config(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest committed checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("prepare", help="turn raw documents into training shards (Ray Data)")
    p.add_argument("src", nargs="+", help="text files, directories, globs, .jsonl or .parquet; local or s3://")
    p.add_argument("--out", required=True, help="output directory or URI (shards, manifest.json, report.json, quarantine.jsonl)")
    with_config(p)
    p.add_argument("--field", help="JSONL key holding the text (prepare.jsonl_field, default 'text')")
    p.add_argument("--column", help="Parquet column holding the text (prepare.parquet_column, default 'text')")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output")
    p.add_argument(
        "--storage-option", action="append", default=[], metavar="KEY=VALUE", help="fsspec option for s3:// (endpoint_url, key, secret ...); never logged"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("scale", help="resize a running job at its next step boundary")
    p.add_argument("run", help="the run directory (or its name)")
    p.add_argument("--workers", type=int, required=True, help="workers wanted")
    p.set_defaults(func=cmd_scale)

    p = sub.add_parser("status", help="a live view of a running job (or, without RUN, the jobs running on this cluster)")
    p.add_argument("run", nargs="?", help="the run directory (or its name)")
    p.add_argument("--once", action="store_true", help="print the view once and exit")
    p.add_argument("--json", action="store_true", help="print the status as JSON once (for scripts)")
    p.add_argument("--every", type=float, default=2.0, help="seconds between refreshes of the live view")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("report", help="plots of a run (loss, throughput with scale events, data wait, world size, grad norms): PNG + HTML")
    p.add_argument("run", help="the run directory")
    p.add_argument("--out", help="where to write the plots (default RUN/report)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("spot-watch", help="on a spot worker node: turn the interruption notice into a Ray drain (cluster.yaml runs it)")
    p.add_argument("--imds", default="http://169.254.169.254", help="instance metadata endpoint")
    p.add_argument("--node-id", help="node to drain; default the node this runs on")
    p.add_argument("--every", type=float, default=5.0, help="seconds between polls (AWS gives 120 s notice)")
    p.set_defaults(func=cmd_spot_watch)

    p = sub.add_parser("tune", help="Bayesian hyper-parameter search (Ray Tune, Optuna TPE, ASHA) over real training runs")
    with_config(p)
    p.add_argument("--space", help="YAML: config keys and their distributions (loguniform, uniform, int, choice)")
    p.add_argument("--trials", type=int, default=20, help="trials to run")
    p.add_argument("--concurrency", type=int, default=1, help="trials at once (each takes cluster.num_workers workers)")
    p.add_argument("--out", default="tune", help="the search's directory: study, trials' runs, trials.json, best.yaml")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed (with --concurrency 1 a search repeats exactly)")
    p.add_argument("--sampler", choices=["tpe", "random"], default="tpe", help="TPE (multivariate) or random search")
    p.add_argument("--no-pruning", action="store_true", help="run every trial to the end (no ASHA)")
    p.add_argument("--resume", action="store_true", help="continue the search in --out; finished trials are not run again")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("config", help="print the resolved config")
    with_config(p)
    p.set_defaults(func=cmd_config)
    return parser


if __name__ == "__main__":
    sys.exit(main())
