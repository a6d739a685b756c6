"""Where a command's details go: the log file a failure's one line names, and the driver's log in a run
directory."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import traceback
from pathlib import Path


def log_traceback(error: BaseException, path: Path | None) -> Path:
    return log_text("".join(traceback.format_exception(error)), path)


def log_text(text: str, path: Path | None) -> Path:
    """`text` appended to the log file `path` (none: a new one under ~/.cache/etrain/logs), after the command."""
    name = f"etrain-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path = path or Path.home() / ".cache" / "etrain" / "logs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} etrain {' '.join(sys.argv[1:])}\n{text.rstrip()}\n")
    return path


@contextlib.contextmanager
def logging_to(path: Path):
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
