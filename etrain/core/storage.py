"""What counts as a storage error, named once for checkpoints, the shard cache, the lease and prepare.

fsspec turns most object-store failures into OSError, but not all: botocore's
connection errors (EndpointConnectionError, ConnectionClosedError, read and connect
timeouts) reach the caller as they are, and they are exactly the brief outages
that a retry mends.
"""

from __future__ import annotations

from botocore.exceptions import BotoCoreError

from etrain.core.errors import Failure

STORAGE_ERRORS: tuple[type[BaseException], ...] = (OSError, BotoCoreError)


class StorageError(Failure):
    """Storage cannot be reached or refuses; the message names the URI and what to do."""


def describe(error: BaseException) -> str:
    """One line for a storage error: its type and its first line (botocore messages name the URL)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
