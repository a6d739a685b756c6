"""`etrain`: the command line. Every failure ends in one line: exit 2 for usage errors, 1 for failed work.

Commands import what they use when they run, so `--help`, `config` and `status RUN` answer without
loading Ray or torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from etrain.core.errors import Failure, UsageError


def main(argv: list[str] | None = None) -> int:
    """Every failure ends in one line on the terminal that names the cause and what to do: exit 2 for
    usage errors, 1 for runtime ones, 130 for Ctrl-C. A traceback goes to the log file the line names."""
    started_at = time.time()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    ours = not _ray_up()  # a Ray this command connects to is shut down by it (the caller's, as in tests, is not)
    try:
        return args.func(args, started_at)
    except UsageError as e:  # raised in an actor (a resume's corrupt checkpoints): its own message, not Ray's
        print(f"etrain: error: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return 2
    except Failure as e:  # raised in an actor: its own message, not Ray's traceback
        what = "training failed" if args.func in (cmd_train, cmd_finetune, cmd_ppo) else "error"
        failure = getattr(e, "cause", e)
        details = getattr(failure, "details", None)
        where = f"\n(details: {_log_text(details, getattr(args, 'log_file', None))})" if details else ""
        print(f"etrain: {what}: {failure}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"etrain: interrupted{getattr(args, 'resume_hint', '')}", file=sys.stderr)
        return 130
    except Exception as e:  # a failure nobody named: its one line here, the details in the log
        from etrain.core.errors import why

        path = _log_traceback(e, getattr(args, "log_file", None))
        print(f"etrain: error: {why(e)}\n(details: {path})", file=sys.stderr)
        return 1
    finally:
        if ours and _ray_up():
            # before the interpreter exits: Ray's threads torn down mid-exit dump C++ stacks
            sys.modules["ray"].shutdown()


def _ray_up() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def _log_traceback(error: BaseException, path: Path | None) -> Path:
    return _log_text("".join(traceback.format_exception(error)), path)


def _log_text(text: str, path: Path | None) -> Path:
    """`text` appended to the log file `path` (none: a new one under ~/.cache/etrain/logs), after the command."""
    name = f"etrain-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path = path or Path.home() / ".cache" / "etrain" / "logs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} etrain {' '.join(sys.argv[1:])}\n{text.rstrip()}\n")
    return path


def cmd_train(args, started_at: float) -> int:
    from etrain.core.config import ConfigError, load_config

    if args.resume and args.config:
        raise ConfigError("--resume takes the run's own config.yaml; drop --config (use --set for resumable keys)")
    if args.restart_if_corrupt and not args.resume:
        raise ConfigError("--restart-if-corrupt is a choice of --resume RUN_DIR: add it, or drop the flag")
    if args.resume:
        if args.init_from:
            raise ConfigError("--resume continues a run from its own checkpoint; drop --init-from")
        return _resume(args, started_at)
    if args.init_from:  # continued pre-training: every weight trains, from the directory's
        return _from_base(args, args.init_from, ["finetune.method=full", *args.set], started_at)
    return _train(args, load_config(args.config, args.set), None, started_at)


def cmd_finetune(args, started_at: float) -> int:
    return _from_base(args, args.source, args.set, started_at)


def cmd_ppo(args, started_at: float) -> int:
    from etrain.core.rewards import load, resolve

    reward = load(resolve(args.reward)).name  # a reward that cannot be loaded: refused first, in one line
    return _from_base(args, args.source, args.set, started_at, {"ppo.reward": reward})


def _from_base(args, source: str, overrides: list[str], started_at: float, then: dict | None = None) -> int:
    """A new run from the weights at `source` (a run, a checkpoint or a Hugging Face directory); `then`: keys set
    once the base is known (PPO's reward, which the config accepts only with a base)."""
    from etrain.core.config import override
    from etrain.core.finetune import finetune_config

    cfg = override(finetune_config(source, args.config, overrides), then or {})
    print(f"base: {cfg.finetune.base}" + "".join(f"; {k}: {v}" for k, v in (then or {}).items()), file=sys.stderr)
    return _train(args, cfg, None, started_at)


def _resume(args, started_at: float) -> int:
    """A run goes on: its own config with the resumable --set keys, refused before anything starts or is written if
    it is not a run that can (an export, a run that has trained all its steps)."""
    from etrain.driver.job import check_resume, durable

    run_dir = durable(Path(args.resume).expanduser().resolve(), "--resume")
    cfg = _resume_config(run_dir, args.set)
    check_resume(run_dir, cfg)
    return _train(args, cfg, run_dir, started_at)


def _train(args, cfg, run_dir: Path | None, started_at: float) -> int:
    """Train `cfg` in `run_dir` (None: a new run's, made once its inputs are checked, so that a refusal leaves no
    directory behind; one refused later, before its job started, is removed again)."""
    from etrain.core.errors import UsageError
    from etrain.driver.job import check_inputs, new_run_dir, train

    cfg = check_inputs(cfg)
    new = run_dir is None
    if new:
        run_dir = new_run_dir(cfg)
    elif args.set:  # a resume's changes to its resumable keys, kept with the run once its inputs passed
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    args.log_file = run_dir / "driver.log"
    args.resume_hint = f"; resume with `etrain train --resume {run_dir}`"
    print(f"run directory: {run_dir}", file=sys.stderr)
    try:
        with _logging_to(args.log_file):
            summary = train(
                cfg,
                run_dir,
                resume=not new,
                started_at=started_at,
                progress=not args.no_progress,
                log_every=args.log_every,
                checked=True,
                restart_if_corrupt=getattr(args, "restart_if_corrupt", False),
            )
    except UsageError:
        if new and not (run_dir / "metrics.jsonl").exists() and not (run_dir / "status.json").exists():
            import shutil

            shutil.rmtree(run_dir, ignore_errors=True)  # nothing but its config: the run never started
            args.log_file = None
        raise
    print(json.dumps(summary, indent=1))
    print(f"metrics: {run_dir / 'metrics.jsonl'}\nsummary: {run_dir / 'summary.json'}", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _logging_to(path: Path):
    """The driver's log to `path` too, beside the terminal's lines."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # the second: Ray's paragraphs on dead workers, kept off the terminal
    loggers = [logging.getLogger(), logging.getLogger("etrain.ray")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        handler.close()


def cmd_prepare(args, started_at: float) -> int:
    from etrain.core.config import load_config
    from etrain.data.prepare import open_output, prepare
    from etrain.driver.job import connect

    sugar = [f"prepare.jsonl_field={args.field}"] * bool(args.field)
    sugar += [f"prepare.parquet_column={args.column}"] * bool(args.column)
    cfg = load_config(args.config, [*sugar, *args.set])
    storage = dict(_parse_option(o) for o in args.storage_option)
    open_output(args.out, storage)  # a wrong option or an unreachable endpoint, named before Ray starts
    if isinstance(cfg.prepare.tokenizer, str) and cfg.prepare.tokenizer != "bytes":  # and a tokenizer that is not
        from etrain.core.config import ConfigError
        from etrain.data.tokenizer import read_file

        try:
            read_file(cfg.prepare.tokenizer)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    connect(cfg)
    report = prepare(args.src, args.out, cfg, overwrite=args.overwrite, storage=storage, progress=not args.no_progress)
    print(json.dumps(report, indent=1))
    out = args.out.rstrip("/")
    print(
        f"manifest: {out}/manifest.json\nreport: {out}/report.json\nquarantine: {out}/quarantine.jsonl", file=sys.stderr
    )
    print(f"train on it: {_train_command(args.config or 'tiny', cfg, out, report)}", file=sys.stderr)
    return 0


def _train_command(config: str, cfg, out: str, report: dict) -> str:
    """`etrain train` on a prepared corpus, with the keys its data needs: the sequence length it was packed at, and
    a vocabulary as large as its tokenizer's when the config's is smaller."""
    vocab = report["vocab_size"]
    keys = [f"data.source={out}/manifest.json", f"model.seq_len={cfg.model.seq_len}"]
    keys += [f"model.vocab_size={vocab}"] * (vocab > cfg.model.vocab_size)
    return f"etrain train --config {shlex.quote(config)} " + " ".join(f"--set {shlex.quote(k)}" for k in keys)


def _parse_option(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise UsageError(
            f"--storage-option {item.split('=')[0]!r} must look like key=value (e.g. endpoint_url=http://127.0.0.1:9000)"
        )
    return key, value


def cmd_scale(args, started_at: float) -> int:
    from etrain.driver import api

    print(json.dumps(api.scale(args.run, args.workers, args.replicas)))
    return 0


def cmd_status(args, started_at: float) -> int:
    """RUN, a run directory: read from the status.json its coordinator keeps (no Ray needed, and a finished
    or failed run shows its last state). A run's name, or no RUN: asked of the Ray cluster."""
    if args.every <= 0:
        raise UsageError(f"--every must be positive, got {args.every}")
    if args.run is None:
        from etrain.driver import api

        names = api.runs()
        print(
            "\n".join(_status_line(api.status(n)) for n in names)
            if names
            else "no etrain job is running on this Ray cluster"
        )
        return 0
    live = not args.once and not args.json
    clear = "\033[H\033[J" if live and sys.stdout.isatty() else ""
    while True:
        st = _read_status(args.run)
        print(clear + (json.dumps(st, indent=1) if args.json else _status_text(st)), flush=True)
        if not live or st["phase"] in ("finished", "failed"):
            return 0
        time.sleep(args.every)


def _read_status(run: str) -> dict:
    path = Path(run) / "status.json"
    if path.is_file():
        from etrain.core.records import read_json

        st = read_json(path)
        st["updated_s_ago"] = time.time() - st["updated"]
        return st
    if Path(run).is_dir():
        raise UsageError(
            f"{run} has no status.json: its job has not started a coordinator (the driver failed before it, or it "
            f"is starting now); `etrain report {run}` summarises its records"
        )
    from etrain.driver import api

    return api.status(run)


def _status_line(st: dict) -> str:
    loss = f"{st['loss']:.3f}" if st["loss"] is not None else "-"
    progress = f"step {st['step']}/{st['total_steps']} loss {loss} workers {st['world_size']}"
    return f"{st['run']}: {st['phase']} {progress} ETA {_duration(st['eta_s'])}"


def _status_text(st: dict) -> str:
    """What `etrain status RUN` shows: progress, model, throughput, membership, last checkpoint, members."""

    def num(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    done = st["step"] / st["total_steps"]
    ckpt = st["last_checkpoint"]
    ended = {"finished": "  (the job has ended)", "failed": f"  (the job failed: {st.get('failure')})"}.get(
        st["phase"], ""
    )
    quiet = st.get("updated_s_ago", 0) > 30 and not ended
    lines = [
        f"run {st['run']}  ({st['run_dir']}){ended}"
        + (f"  (no update for {_duration(st['updated_s_ago'])}: is its driver alive?)" if quiet else ""),
        f"  {st['phase']:<13} step {st['step']}/{st['total_steps']} ({done:.0%})  elapsed {_duration(st['elapsed_s'])} "
        f" ETA {_duration(st['eta_s'])}",
        f"  loss {num(st['loss'], '.4f')}  eval loss {num(st['eval_loss'], '.4f')}  tokens/s "
        f"{num(st['tokens_per_s'], ',.0f')}  MFU {num(st['mfu'], '.1%')}",
        f"  workers {st['world_size']} (wanted {st['wanted']}{', autoscaling' if st['autoscaling'] else ''})  warm "
        f"pool {st['warm_pool_ready']} ready"
        f"  recoveries {st['recoveries']}  group generation {st['generation']}  sync {st['comm']}",
        "  last checkpoint: " + (f"step {ckpt['step']} ({ckpt['level']}) {ckpt['path']}" if ckpt else "none yet"),
    ]
    if st.get("communication"):
        lines.append(f"  communication: {st['communication']}")
    health = st.get("health") or {"nodes": {}, "lemons": []}
    node = _node_names(
        [*st["draining_nodes"], *health["nodes"], *health["lemons"], *(m["node"] for m in st["members"])]
    )
    lay = st.get("layout")
    if lay and lay["ranks"] > 1:
        pipeline = f", {lay['schedule']} over {lay['microbatches']} micro-batches" if lay["pp"] > 1 else ""
        shape = f"tp {lay['tp']} × pp {lay['pp']} × shard {lay.get('shard', 1)} = {lay['ranks']} ranks"
        lines.append(f"  layout: {lay['replicas']} replica(s) of {shape}{pipeline}")
    if st["draining_nodes"]:
        lines.append(f"  draining nodes (preemption or health): {', '.join(map(node, st['draining_nodes']))}")
    lines += _health_lines(health, node)
    for m in st["members"]:
        speed = f"{m['speed']:.1f} samples/s" if m["speed"] else "speed not measured yet"
        place = ""
        if "replica" in m:
            place = f"  replica {m['replica']} stage {m['stage']} shard {m['shard']} tp_rank {m['tp_rank']}"
        lines.append(f"    rank {m['rank']}: node {node(m['node'])} pid {m['pid']}{place}  {speed}")
    return "\n".join(lines)


def _node_names(nodes: list[str | None]) -> Callable[[str | None], str]:
    """Node ids as short as tells them apart, 8 characters at least, as git shortens commits: Ray's fake nodes (and
    some real ones) share their first 8."""
    ids = sorted({n for n in nodes if n})
    common = max((len(os.path.commonprefix(pair)) for pair in zip(ids, ids[1:])), default=0)
    width = max(8, common + 1)
    return lambda n: n[:width] if n else "?"


def _health_lines(health: dict, node: Callable[[str | None], str]) -> list[str]:
    """Each node's failure risk and its reasons, worst first; the lemons."""
    lines = []
    for name, h in sorted(health["nodes"].items(), key=lambda kv: -kv[1]["risk"]):
        why = "; ".join(h["reasons"]) or "no signal"
        cool = f", cooling down {_duration(h['cooldown_s'])}" if h.get("cooldown_s") else ""
        drill = " [synthetic]" if h["synthetic"] else ""
        lines.append(f"  node {node(name)} risk {h['risk']:.2f} {h['state']}{cool}{drill}: {why}")
    if health["lemons"]:
        lines.append(f"  lemons (drained repeatedly): {', '.join(map(node, health['lemons']))}")
    return lines


def _duration(seconds: float | None) -> str:
    from tqdm import tqdm

    return "-" if seconds is None else tqdm.format_interval(seconds)


def cmd_report(args, started_at: float) -> int:
    from etrain.driver.report import write_report

    report = write_report(Path(args.run), Path(args.out) if args.out else None)
    print(json.dumps(report["summary"], indent=1))
    print(f"report: {report['html']}", file=sys.stderr)
    for name, path in report["plots"].items():
        print(f"{name}: {path}", file=sys.stderr)
    return 0


def cmd_cluster(args, started_at: float) -> int:
    from etrain.driver import local_cluster

    if args.action == "up":
        cluster = local_cluster.up(args.cpus, fake=not args.no_autoscaler, reachable=args.reachable)
        print(local_cluster.exports(cluster))
        print(
            f"Ray head at {cluster.address} (dashboard {cluster.dashboard}); its clients need the variables above: "
            f'eval "$(etrain cluster env)"; stop it with `etrain cluster down`',
            file=sys.stderr,
        )
    elif args.action == "env":
        print(local_cluster.exports(local_cluster.current()))
    else:
        cluster = local_cluster.down()
        print(f"stopped the Ray head at {cluster.address} and its nodes", file=sys.stderr)
    return 0


def cmd_spot_watch(args, started_at: float) -> int:
    from etrain.driver.spot import watch

    print(json.dumps(watch(args.imds, args.node_id, args.every)))
    return 0


def cmd_tune(args, started_at: float) -> int:
    from etrain.core.config import ConfigError, load_config, override
    from etrain.driver.job import connect, resolve_data, train
    from etrain.tune.search import GRACE, REDUCTION, check, format_table, run_search
    from etrain.tune.space import load_space

    if args.trials < 1 or args.concurrency < 1:
        raise ConfigError(f"--trials and --concurrency must be at least 1, got {args.trials} and {args.concurrency}")
    if args.resume and (args.reduction is not None or args.grace is not None):
        raise ConfigError(
            "--reduction and --grace are fixed when a search starts (its study holds the scheduler): a resumed "
            "search keeps its own; leave them out, or start a new search with another --out"
        )
    if args.reduction is not None and args.reduction <= 1 or args.grace is not None and args.grace < 1:
        raise ConfigError(f"--reduction must be above 1 and --grace at least 1, got {args.reduction} and {args.grace}")
    out = Path(args.out)
    if args.resume:
        saved = out / "search.json"
        if not saved.is_file():
            raise ConfigError(f"no search to resume under {out} (no search.json); start one without --resume")
        spec = json.loads(saved.read_text())
        base, space_file = load_config(str(out / "base.yaml")), spec["space"]
    else:
        if not args.space:
            raise ConfigError(
                "--space SPACE.yaml is required (config keys and their distributions; see etrain/tune/space.py)"
            )
        base, space_file = load_config(args.config, args.set), str(Path(args.space).resolve())
        spec = {
            "space": space_file,
            "trials": args.trials,
            "concurrency": args.concurrency,
            "seed": args.seed,
            "sampler": args.sampler,
            "pruning": not args.no_pruning,
            "reduction": args.reduction or REDUCTION,
            "grace": args.grace or GRACE,
        }
    space = load_space(space_file, base)
    if not args.resume and args.grace and spec["pruning"] and args.grace * base.train.eval_every >= base.train.steps:
        raise ConfigError(
            f"--grace {args.grace} evaluations of train.eval_every={base.train.eval_every} steps reach "
            f"train.steps={base.train.steps}: ASHA would stop nothing; lower --grace or pass --no-pruning"
        )
    if not args.resume:
        if (out / "study").exists():
            raise ConfigError(f"{out} already holds a search; continue it with --resume, or choose another --out")
        out.mkdir(parents=True, exist_ok=True)
        (out / "base.yaml").write_text(base.to_yaml())
        (out / "search.json").write_text(json.dumps(spec, indent=1) + "\n")
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


def cmd_export(args, started_at: float) -> int:
    from etrain.driver.export import export

    # --out as given, not resolved: a link in it is export's to judge (a dangling one is refused)
    run, out = Path(args.run).expanduser().resolve(), Path(args.out).expanduser().absolute()
    written = export(run, out, args.merge, args.format)
    print(json.dumps(written, indent=1))
    return 0


def cmd_generate(args, started_at: float) -> int:
    import torch

    from etrain.core.config import ConfigError
    from etrain.driver.generate import generate, load

    if not 0 <= args.temperature < math.inf or not 0 < args.top_p <= 1 or args.max_new_tokens < 1:  # nan: False
        raise ConfigError(
            f"--temperature must be a finite number >= 0 (got {args.temperature:g}), --top-p in (0, 1] (got "
            f"{args.top_p:g}), --max-new-tokens >= 1 (got {args.max_new_tokens})"
        )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    loaded = load(args.source, device)
    print(f"model: {loaded.source}", file=sys.stderr)
    codec = loaded.codec
    prompt = codec.encode(args.prompt)
    tokens = generate(loaded.model, prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed, codec.eos)
    print(args.prompt + codec.decode(tokens))
    return 0


def cmd_config(args, started_at: float) -> int:
    from etrain.core.config import load_config

    cfg = load_config(args.config, args.set)
    print(cfg.to_yaml(), end="")
    need, here = cfg.worker_memory(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    par = cfg.parallel
    layout = f" in a layout of tp {par.tp} × pp {par.pp} × shard {par.shard}" if par.ranks > 1 else ""
    parts = ", ".join(f"{part} {size / 2**30:,.2f}" for part, size in cfg.rank_memory().items() if size)
    print(
        f"model: {cfg.model.param_count():,} parameters; about {need / 2**30:,.2f} GiB per worker{layout} "
        f"({parts} GiB; activations of one micro-batch)",
        file=sys.stderr,
    )
    if need > here and not cfg.cluster.gpus_per_worker:
        print(f"warning: that is more than this machine's {here / 2**30:,.1f} GiB of memory", file=sys.stderr)
    return 0


def _resume_config(run_dir: Path, overrides: list[str]):
    from etrain.core.config import RESUMABLE, ConfigError, load_config

    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(
            f"{run_dir} is not a run directory (no config.yaml); give the directory `etrain train` printed"
        )
    for item in overrides:
        key = item.partition("=")[0].strip()
        if not any(key == k or key.startswith(k + ".") for k in RESUMABLE):
            raise ConfigError(
                f"--set {key} cannot change on resume (it changes what is trained); resumable: {', '.join(RESUMABLE)}"
            )
    return load_config(str(saved), overrides)


class _Help(argparse.RawDescriptionHelpFormatter):
    """Defaults beside the options that have one, examples as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, [], argparse.SUPPRESS) or action.option_strings == ["-h", "--help"]:
            return action.help
        return f"{action.help} (default: {action.default})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="etrain",
        description="Elastic transformer training on Ray.",
        formatter_class=_Help,
        epilog="examples:\n  etrain train --config tiny\n  etrain status runs/NAME\n  etrain COMMAND --help",
    )
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, func, help: str, *examples: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help,
            description=help,
            formatter_class=_Help,
            epilog="examples:\n" + "\n".join(f"  {e}" for e in examples),
        )
        p.set_defaults(func=func)
        return p

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config",
            "-c",
            help="preset name in etrain/configs/ (tiny, small, gpu-125m, gpu-1b) or a YAML file; none: the defaults",
        )
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key, e.g. train.steps=100 (repeatable)",
        )

    def with_progress(p: argparse.ArgumentParser) -> None:
        p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines (events only)")
        p.add_argument(
            "--log-every",
            type=float,
            default=30.0,
            metavar="SECONDS",
            help="off a terminal (job logs): one progress line per interval",
        )

    def with_base(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument(
            "--from",
            dest="source",
            required=True,
            metavar="RUN_OR_CHECKPOINT",
            help=f"{what}: a run directory (its latest checkpoint; its config, unless --config), a checkpoint "
            "directory, or one checkpoint (step-N)",
        )

    p = command(
        "train",
        cmd_train,
        "train a model (a new run, or --resume RUN_DIR)",
        "etrain train --config tiny --set train.steps=500",
        "etrain train --resume runs/20261129-123456 --set train.steps=800",
        "etrain train --init-from models/Llama-3.2-1B --config small --set model.seq_len=1024",
    )
    with_config(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest committed checkpoint")
    p.add_argument(
        "--restart-if-corrupt",
        action="store_true",
        help="with --resume: when every committed checkpoint of the run fails verification, train it from step 0 "
        "instead of stopping (exit 2)",
    )
    p.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from these weights, every one trained (continued pre-training): a Hugging Face model "
        "directory (its model section), a run or a checkpoint",
    )
    with_progress(p)

    p = command(
        "finetune",
        cmd_finetune,
        "fine-tune a trained model: LoRA adapters on it (the default) or all its weights; resume with etrain train",
        "etrain finetune --from runs/base --set data.source=corpus/ --set train.steps=200",
        "etrain finetune --from runs/base/checkpoints/step-00000500 --config ft.yaml --set finetune.lora.rank=4",
        "etrain finetune --from runs/base --set finetune.method=full --set optim.lr=3e-4",
    )
    with_config(p)
    with_base(p, "the model to fine-tune")
    with_progress(p)

    p = command(
        "ppo",
        cmd_ppo,
        "align a trained model to a reward with PPO (LoRA by default); resume with etrain train",
        "etrain ppo --from runs/base --reward brackets --set train.steps=100",
        "etrain ppo --from runs/base --reward my_reward.py:score --set finetune.method=full --set optim.lr=1e-4",
    )
    with_config(p)
    with_base(p, "the policy's starting point and the frozen reference")
    p.add_argument(
        "--reward",
        required=True,
        metavar="NAME_OR_FILE.py:function",
        help="a built-in task (digits, brackets, length) or a function (prompt, response) -> float",
    )
    with_progress(p)

    p = command(
        "export",
        cmd_export,
        "write a run's trained weights as a plain model (a LoRA run's adapters merged into its base)",
        "etrain export runs/lora --merge --out models/lora-merged",
        "etrain export runs/llama --format hf --out models/llama-hf",
    )
    p.add_argument("run", metavar="RUN_DIR", help="the run whose latest committed checkpoint is exported")
    p.add_argument("--out", required=True, help="a new or empty directory: config.yaml and checkpoints/")
    p.add_argument("--merge", action="store_true", help="fold a LoRA run's adapters into its base's weights")
    p.add_argument(
        "--format",
        choices=("run", "hf"),
        default="run",
        help="run: config.yaml and checkpoints/ (etrain finetune --from takes it); hf: a Hugging Face directory "
        "(config.json, sharded safetensors and their index) of a model.family=llama run",
    )

    p = command(
        "generate",
        cmd_generate,
        "continue a prompt with a trained model: a run, a checkpoint or a Hugging Face directory (KV cache)",
        'etrain generate runs/tiny --prompt "def main():" --max-new-tokens 64',
        'etrain generate models/llama-hf --prompt "Once upon a time" --temperature 0.8 --top-p 0.95 --seed 1',
    )
    p.add_argument("source", metavar="RUN_OR_DIR", help="a run directory, a checkpoint, or a Hugging Face directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many tokens (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: the likeliest token each time (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="draw within the tokens holding this much probability")
    p.add_argument("--seed", type=int, default=0, help="the draws' seed (default: 0)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where there is one")

    p = command(
        "prepare",
        cmd_prepare,
        "turn raw documents into training shards (Ray Data)",
        "etrain prepare docs/ dump.jsonl --out corpus/ --field body",
        "etrain prepare s3://raw/crawl/ --out s3://bucket/corpus --storage-option endpoint_url=http://127.0.0.1:9000",
    )
    p.add_argument("src", nargs="+", help="text files, directories, globs, .jsonl or .parquet; local or s3://")
    p.add_argument(
        "--out", required=True, help="output directory or URI (shards, manifest.json, report.json, quarantine.jsonl)"
    )
    with_config(p)
    p.add_argument("--field", help="JSONL key holding the text (prepare.jsonl_field; none: 'text')")
    p.add_argument("--column", help="Parquet column holding the text (prepare.parquet_column; none: 'text')")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output")
    p.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec option for s3:// (endpoint_url, key, secret ...); never logged",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")

    p = command(
        "scale",
        cmd_scale,
        "resize a running job at its next step boundary",
        "etrain scale runs/20261129-123456 --workers 3   (or --replicas 2 with a layout: parallel.tp, pp or shard > 1)",
    )
    p.add_argument("run", help="the run directory (or its name)")
    wanted = p.add_mutually_exclusive_group(required=True)
    wanted.add_argument("--workers", type=int, help="workers wanted (with a layout, a multiple of tp × pp × shard)")
    wanted.add_argument("--replicas", type=int, help="model replicas wanted, tp × pp × shard workers each")

    p = command(
        "status",
        cmd_status,
        "a live view of a job, running or ended (or, without RUN, the jobs running on this cluster)",
        "etrain status",
        "etrain status runs/20261129-123456",
        "etrain status runs/20261129-123456 --json",
    )
    p.add_argument(
        "run", nargs="?", help="the run directory (read from its status.json), or a running job's name (asked of Ray)"
    )
    p.add_argument("--once", action="store_true", help="print the view once and exit")
    p.add_argument("--json", action="store_true", help="print the status as JSON once (for scripts)")
    p.add_argument("--every", type=float, default=2.0, help="seconds between refreshes of the live view")

    p = command(
        "report",
        cmd_report,
        "plots of a run (loss, throughput with scale events, data wait, world size, grad norms): PNG + HTML",
        "etrain report runs/20261129-123456",
    )
    p.add_argument("run", help="the run directory")
    p.add_argument("--out", help="where to write the plots (none: RUN/report)")

    p = command(
        "cluster",
        cmd_cluster,
        "a Ray head on this machine, with token authentication and the autoscaler on Ray's fake multi-node provider",
        'etrain cluster up && eval "$(etrain cluster env)"',
        "ray job submit -- etrain train --config tiny --set cluster.max_workers=2",
        "etrain cluster down",
    )
    p.add_argument(
        "action",
        choices=["up", "env", "down"],
        help="start it, print the exports its clients need, or stop it (its processes only, never `ray stop`)",
    )
    p.add_argument(
        "--cpus",
        type=int,
        default=1,
        help="CPUs of the head (the autoscaler adds 2-CPU nodes: etrain/driver/local_cluster.yaml)",
    )
    p.add_argument("--no-autoscaler", action="store_true", help="a plain head, without the fake multi-node autoscaler")
    p.add_argument(
        "--reachable",
        action="store_true",
        help="listen on this machine's network address too (default: 127.0.0.1 alone); its Prometheus metrics "
        "endpoints take no token",
    )

    p = command(
        "spot-watch",
        cmd_spot_watch,
        "on a spot worker node: turn the interruption notice into a Ray drain (cluster.yaml runs it)",
        "etrain spot-watch --every 5",
    )
    p.add_argument("--imds", default="http://169.254.169.254", help="instance metadata endpoint")
    p.add_argument("--node-id", help="node to drain; none: the node this runs on")
    p.add_argument("--every", type=float, default=5.0, help="seconds between polls (AWS gives 120 s notice)")

    p = command(
        "tune",
        cmd_tune,
        "Bayesian hyper-parameter search (Ray Tune, Optuna TPE, ASHA) over real training runs",
        "etrain tune --config tiny --space space.yaml --trials 24 --concurrency 2 --out tune/",
        "etrain tune --resume --out tune/",
    )
    with_config(p)
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

    p = command(
        "config",
        cmd_config,
        "print the resolved config, and the model's size and memory per worker",
        "etrain config --config small --set optim.lr=1e-3",
    )
    with_config(p)
    return parser


if __name__ == "__main__":
    sys.exit(main())
