"""A fault as a worker carries it out (the kinds: etrain/control/faults.py, which hands each to its rank)."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass


@dataclass
class Injected:
    """The faults a worker carries from one step to the next, which its engine's step reads."""

    slowdown: float = 1.0  # > 1: a straggler (kinds slow, degrade, noisy)
    poisoned: float = 0.0  # this step's loss is multiplied by it (kinds nan, spike)
    failing: dict | None = None  # a fault of kind degrade, ecc or noisy: `tick` acts on it each step


def apply(fault: dict | None, injected: Injected, sync=None) -> None:
    """In the worker, as its step begins. `sync`: its gradient sync (compress.py), where a
    kill_in_allreduce dies; without one there is no collective to die in, and it dies at once."""
    if not fault:
        return
    kind = fault["kind"]
    if kind == "kill" or (kind == "kill_in_allreduce" and sync is None):
        os._exit(1)
    elif kind == "kill_in_allreduce":
        sync.die_in_allreduce = True
    elif kind == "hang":
        time.sleep(10**6)
    elif kind == "slow":
        injected.slowdown = fault["factor"]
    elif kind == "nan":
        injected.poisoned = float("nan")
    elif kind == "spike":
        injected.poisoned = fault["factor"]
    elif kind in ("degrade", "ecc", "noisy"):
        injected.failing = fault


def tick(injected: Injected, step: int) -> None:
    """In the worker, as step `step` (1-based) begins: a slowly failing worker's slowdown for it, or its death."""
    fault = injected.failing
    if not fault:
        return
    if fault["until"] is not None and step >= fault["until"]:
        os._exit(1)
    if fault["kind"] == "degrade":
        injected.slowdown = 1 + (fault["factor"] - 1) * (step - fault["step"] + 1)
    elif fault["kind"] == "noisy":
        injected.slowdown = 1 + (fault["factor"] - 1) * random.Random(step * 7919 + fault["rank"]).random()
