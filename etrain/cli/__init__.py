"""`etrain`: the command line. Every failure ends in one line: exit 2 for usage errors, 1 for failed work.

Commands import what they use when they run, so `--help`, `config` and `status RUN` answer without
loading Ray or torch. One module per command, each with `add_command` (its parser) and `cmd_*` (its work);
options.py holds the option groups they share, jobs.py the training job of train, finetune, ppo and grpo, logs.py the
log files.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from etrain.cli import (
    cluster,
    config,
    export,
    finetune,
    generate,
    ppo,
    prepare,
    report,
    scale,
    spot_watch,
    status,
    train,
    tune,
)
from etrain.cli.logs import log_text, log_traceback
from etrain.cli.options import Help
from etrain.core.errors import Failure, UsageError

# In the order `etrain --help` lists them.
COMMANDS = (train, finetune, ppo, export, generate, prepare, scale, status, report, cluster, spot_watch, tune, config)
TRAINING = (train.cmd_train, finetune.cmd_finetune, ppo.cmd_ppo, ppo.cmd_grpo)  # their failure is "training failed"


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
        what = "training failed" if args.func in TRAINING else "error"
        failure = getattr(e, "cause", e)
        details = getattr(failure, "details", None)
        where = f"\n(details: {log_text(details, getattr(args, 'log_file', None))})" if details else ""
        print(f"etrain: {what}: {failure}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"etrain: interrupted{getattr(args, 'resume_hint', '')}", file=sys.stderr)
        return 130
    except Exception as e:  # a failure nobody named: its one line here, the details in the log
        from etrain.core.errors import why

        path = log_traceback(e, getattr(args, "log_file", None))
        print(f"etrain: error: {why(e)}\n(details: {path})", file=sys.stderr)
        return 1
    finally:
        if ours and _ray_up():
            # before the interpreter exits: Ray's threads torn down mid-exit dump C++ stacks
            sys.modules["ray"].shutdown()


def _ray_up() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def _parser() -> argparse.ArgumentParser:
    """`etrain` and its commands, each added by its module."""
    parser = argparse.ArgumentParser(
        prog="etrain",
        description="Elastic transformer training on Ray.",
        formatter_class=Help,
        epilog="examples:\n  etrain train --config tiny\n  etrain status runs/NAME\n  etrain COMMAND --help",
    )
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.add_command(sub)
    return parser
