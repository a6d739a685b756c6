"""`etrain train`: a new run from a config, a run resumed from its latest committed checkpoint (--resume), or
continued pre-training from a model's weights (--init-from)."""

from __future__ import annotations

from pathlib import Path

from etrain.cli.jobs import from_base, train_job
from etrain.cli.options import add_config, add_progress, command


def add_command(sub) -> None:
    p = command(
        sub,
        "train",
        cmd_train,
        "train a model (a new run, or --resume RUN_DIR)",
        "etrain train --config tiny --set train.steps=500",
        "etrain train --resume runs/20261129-123456 --set train.steps=800",
        "etrain train --init-from models/Llama-3.2-1B --config small --set model.seq_len=1024",
    )
    add_config(p)
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
    add_progress(p)


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
        return from_base(args, args.init_from, ["finetune.method=full", *args.set], started_at)
    return train_job(args, load_config(args.config, args.set), None, started_at)


def _resume(args, started_at: float) -> int:
    """A run goes on: its own config with the resumable --set keys, refused before anything starts or is written if
    it is not a run that can (an export, a run that has trained all its steps)."""
    from etrain.driver.job import check_resume, durable

    run_dir = durable(Path(args.resume).expanduser().resolve(), "--resume")
    cfg = _resume_config(run_dir, args.set)
    check_resume(run_dir, cfg)
    return train_job(args, cfg, run_dir, started_at)


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
