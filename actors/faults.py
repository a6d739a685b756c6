"""Failure injection for tests and drills (config `faults`): which worker fails how, and at which step.

`FaultPlan.due(step)` hands each fault to its rank once, with that step's work; the worker
calls `apply`. Kinds: kill (the process exits, as a lost node), hang (it stops answering),
slow (a straggler: compute takes `factor` times as long from then on), nan and spike (the
loss is poisoned: a non-finite or a huge gradient), and kill_in_allreduce (the process exits
inside the gradient all-reduce, after sending its first bucket: peers fail mid-collective).
"""

from __future__ import annotations

import os
import time

from app.core.config import Fault


class FaultPlan:
    def __init__(self, faults: list[Fault]):
        self.faults, self.fired = faults, set()

    def due(self, step: int) -> dict[int, dict]:
        """rank -> the fault it meets at `step` (1-based), each fault once."""
        due = {i: f for i, f in enumerate(self.faults) if f.step == step and i not in self.fired}
        self.fired |= set(due)
        return {f.rank: f.model_dump() for f in due.values()}


def apply(fault: dict | None, worker) -> None:
    """In the worker, as its step begins."""
    if not fault:
        return
    kind = fault["kind"]
    if kind == "kill" or (kind == "kill_in_allreduce" and worker.sync is None):  # alone: no collective to die in
        os._exit(1)
    elif kind == "kill_in_allreduce":
        worker.sync.die_in_allreduce = True
    elif kind == "hang":
        time.sleep(10**6)
    elif kind == "slow":
        worker.slowdown = fault["factor"]
    elif kind == "nan":
        worker.poisoned = float("nan")
    elif kind == "spike":
        worker.poisoned = fault["factor"]
