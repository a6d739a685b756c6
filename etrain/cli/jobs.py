"""A training job from the command line, shared by train, finetune and ppo: its run directory (made once its
inputs pass, removed again if it is refused before its job started), its driver log, and its summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from etrain.cli.logs import logging_to


def from_base(
    args,
    source: str,
    overrides: list[str],
    started_at: float,
    then: dict | None = None,
    adapter: str | None = None,
    chat: str | None = None,
) -> int:
    """A new run from the weights at `source` (a run, a checkpoint or a Hugging Face directory), its LoRA adapters
    from `adapter` (a PEFT directory) where given, trained on the chat records in `chat` where given; `then`: keys
    set once the base is known (PPO's reward, which the config accepts only with a base)."""
    from etrain.core.config import override
    from etrain.core.finetune import finetune_config

    cfg = override(finetune_config(source, args.config, overrides, adapter), then or {})
    if chat is not None:
        cfg = override(cfg, {"data.source": chat_source(cfg, chat)})
    print(f"base: {cfg.finetune.base}" + "".join(f"; {k}: {v}" for k, v in (then or {}).items()), file=sys.stderr)
    return train_job(args, cfg, None, started_at)


def chat_source(cfg, data: str) -> str:
    """The prepared manifest of the chat records at `data`, rendered with the base's tokenizer and template."""
    from etrain.core import hf
    from etrain.core.config import ConfigError
    from etrain.data import chat

    if not hf.is_model_dir(cfg.finetune.base):
        raise ConfigError(
            f"--data renders chat records with the base's chat template and tokenizer: --from a Hugging Face "
            f"directory that has them (the base {cfg.finetune.base} is a run)"
        )
    local = "://" not in data
    data = str(Path(data).expanduser().resolve()) if local else data
    root = str(Path(cfg.run.root).expanduser().resolve())
    manifest = chat.prepared(data, cfg.finetune.base, cfg.model.seq_len, cfg.data.eval_fraction, root)
    print(f"chat data: {manifest}", file=sys.stderr)
    return manifest


def train_job(args, cfg, run_dir: Path | None, started_at: float) -> int:
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
        with logging_to(args.log_file):
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
