"""The pieces every command's parser is built from: the help format, a command with its examples, and the option
groups several commands share (a config and its overrides, progress output, the model a run starts from)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


class Help(argparse.RawDescriptionHelpFormatter):
    """Defaults beside the options that have one, examples as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, [], argparse.SUPPRESS) or action.option_strings == ["-h", "--help"]:
            return action.help
        return f"{action.help} (default: {action.default})"


def command(sub, name: str, func: Callable, help: str, *examples: str) -> argparse.ArgumentParser:
    """`etrain NAME`, run by `func(args, started_at)`, its help and examples shown by `etrain NAME --help`."""
    p = sub.add_parser(
        name,
        help=help,
        description=help,
        formatter_class=Help,
        epilog="examples:\n" + "\n".join(f"  {e}" for e in examples),
    )
    p.set_defaults(func=func)
    return p


def add_config(p: argparse.ArgumentParser) -> None:
    """--config and --set: the config a command loads (etrain.core.config.load_config)."""
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


def add_progress(p: argparse.ArgumentParser) -> None:
    """--no-progress and --log-every: how a training command shows its progress."""
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines (events only)")
    p.add_argument(
        "--log-every",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="off a terminal (job logs): one progress line per interval",
    )


def add_base(p: argparse.ArgumentParser, what: str) -> None:
    """--from: the trained model a new run starts from (`what` says what it is to this command)."""
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="RUN_OR_CHECKPOINT",
        help=f"{what}: a run directory (its latest checkpoint; its config, unless --config), a checkpoint "
        "directory, or one checkpoint (step-N)",
    )
