"""Python API for a running job (notebooks, scripts): where it stands, and how many workers it should have.

A run's coordinator is the named actor `etrain:RUN` in Ray namespace `etrain`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import ray

from etrain.core.config import ConfigError, TimeoutConfig
from etrain.driver.connect import NAMESPACE, connect

CONNECT_S = TimeoutConfig().connect_s  # connecting and asking a coordinator: bounded, never a hang


def _connect() -> None:
    connect(os.environ.get("RAY_ADDRESS") or "auto", CONNECT_S)


def coordinator(run: str, wait_s: float = 0.0):
    """The run's coordinator actor; `wait_s`: how long to wait for a job that is starting to create it."""
    _connect()
    name = f"etrain:{Path(run).name}"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return ray.get_actor(name)
        except ValueError:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise ConfigError(
                f"no running job {name!r} on this Ray cluster; is `etrain train` still running for {run}?"
            ) from None


def runs() -> list[str]:
    """Names of the jobs running on this Ray cluster."""
    _connect()
    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        a["name"].split(":", 1)[1] for a in named if a["namespace"] == NAMESPACE and a["name"].startswith("etrain:")
    )


def status(run: str) -> dict:
    try:
        return ray.get(coordinator(run).status.remote(), timeout=CONNECT_S)
    except ray.exceptions.RayActorError:
        raise ConfigError(f"the job {Path(run).name!r} ended while being asked for its status") from None
    except ray.exceptions.GetTimeoutError:
        raise ConfigError(
            f"the job {Path(run).name!r} did not answer within {CONNECT_S:.0f} s: its coordinator is hung or its node "
            "unreachable"
        ) from None


def scale(run: str, workers: int | None = None, replicas: int | None = None) -> dict:
    """Ask for `workers` members, or `replicas` model replicas (tp × pp × shard workers each), from the next step
    boundary on; returns the status at the time of asking."""
    handle = coordinator(run)
    try:
        ray.get(handle.request_scale.remote(workers, replicas), timeout=CONNECT_S)
    except ValueError as e:
        raise ConfigError(str(getattr(e, "cause", e))) from None
    return status(run)
