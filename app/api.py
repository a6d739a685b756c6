"""Python API for a running job (notebooks, scripts): where it stands, and how many workers it should have.

A run's coordinator is the named actor `etrain:RUN` in Ray namespace `etrain`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import ray

from app.config import ConfigError

NAMESPACE = "etrain"


def coordinator(run: str):
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), namespace=NAMESPACE, logging_level=logging.WARNING)
    name = f"etrain:{Path(run).name}"
    try:
        return ray.get_actor(name)
    except ValueError:
        raise ConfigError(f"no running job {name!r} on this Ray cluster; is `etrain train` still running for {run}?") from None


def status(run: str) -> dict:
    return ray.get(coordinator(run).status.remote())


def scale(run: str, workers: int) -> dict:
    """Ask for `workers` members from the next step boundary on; returns the status at the time of asking."""
    handle = coordinator(run)
    try:
        ray.get(handle.request_scale.remote(workers))
    except ValueError as e:
        raise ConfigError(str(getattr(e, "cause", e))) from None
    return ray.get(handle.status.remote())
