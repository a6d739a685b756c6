"""The two kinds of failure a user is told about, named once: what they gave is wrong (exit code 2), or
the work could not be done (exit code 1). Every error the CLI turns into one line derives from one of
these. This module imports nothing, so the CLI can name them without loading Ray or torch."""


class UsageError(ValueError):
    """What the user gave is wrong (a config, a data source, an argument, a run another driver owns);
    the message says what and what to do. Exit code 2."""


class Failure(RuntimeError):
    """The work could not be done (training, storage); the message says why and what to do. Exit code 1."""
