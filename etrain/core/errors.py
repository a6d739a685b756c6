"""The two kinds of failure a user is told about, named once: what they gave is wrong (exit code 2), or
the work could not be done (exit code 1). Every error the CLI turns into one line derives from one of
these. This module imports nothing, so the CLI can name them without loading Ray or torch."""


class UsageError(ValueError):
    """What the user gave is wrong (a config, a data source, an argument, a run another driver owns);
    the message says what and what to do. Exit code 2."""


class Failure(RuntimeError):
    """The work could not be done (training, storage); the message says why and what to do. Exit code 1.
    `details`: what the one line leaves out (a worker's traceback), for the log file the line names."""

    def __init__(self, message: str, details: str | None = None):
        super().__init__(message)
        self.details = details


def why(error: BaseException) -> str:
    """A failure in one line: the failing exception's own last line, not Ray's wrapper around it (an
    actor that died in its constructor carries the constructor's exception in its message)."""
    cause = getattr(error, "cause", None) or error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if getattr(cause, "actor_init_failed", False):
        return last[:300]
    return f"{type(cause).__name__}: {last}"[:300]
