"""Failure injection for tests and drills (config `faults`): which worker fails how, and at which step.

`FaultPlan.due(step)` hands each fault to its rank once, with that step's work; the worker
carries it out (etrain/worker/injection.py). Kinds: kill (the process exits, as a lost node), hang (it stops answering),
slow (a straggler: compute takes `factor` times as long from then on), nan and spike (the
loss is poisoned: a non-finite or a huge gradient), and kill_in_allreduce (the process exits
inside the gradient all-reduce, after sending its first bucket: peers fail mid-collective).

Nodes that fail slowly (docs/elastic.md, "Node health"): degrade (compute slows a little more each step, then the
process dies at `until`), ecc (the rank's node reports single-bit ECC errors at a rising rate, then an
uncorrectable one `warning` steps before the process dies at `until`: `FaultPlan.readings`, synthetic), and
noisy (compute time varies by up to `factor` times, every step; it never fails).

A slow network: link (from its step on, every rank's gradient collectives take the time a ring over a link of
`gbps` and `latency_ms` would need for the bytes they send: etrain/worker/link.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from etrain.core.config import Fault
from etrain.core.health import READING_FIELDS, Reading, read_script
from etrain.core.records import FaultFired, Record


class FaultPlan:
    def __init__(self, faults: list[Fault], record: Callable[[Record], None], fired: list[dict] = ()):
        """`fired`: faults the run injected before (a resumed run's earlier drivers): each is injected once."""
        self.faults, self.record = faults, record
        # a record made before a key was added to Fault lacks it: the keys it has must match
        self.fired = {i for i, f in enumerate(faults) if any(_same(f.model_dump(), r) for r in fired)}
        self.bound: dict[int, str | None] = {}  # ecc fault -> the node that reports it

    def due(self, step: int, pool_ready: bool = True, during: str = "step") -> dict[int, dict]:
        """rank -> the fault it meets at `step` (1-based; `during` its work or the evaluation after it), each fault
        once; one that waits for a ready pool worker (`ready_pool`) at the first step from its own on where there
        is one, and one such fault a step (a ready worker replaces one loss: two held faults firing together could
        take every worker)."""
        due = {
            i: f
            for i, f in enumerate(self.faults)
            if i not in self.fired
            and f.kind != "link"
            and f.during == during
            and (f.step == step or f.ready_pool and f.step < step)
            and (pool_ready or not f.ready_pool)
        }
        held = [i for i, f in due.items() if f.ready_pool]
        due = {i: f for i, f in due.items() if not f.ready_pool or i == min(held)}
        self.fired |= set(due)
        for f in due.values():
            self.record(FaultFired(step, f.model_dump()))
        return {f.rank: f.model_dump() for f in due.values()}

    def held(self, step: int) -> bool:
        """Whether a fault waiting for a ready pool worker (`ready_pool`) is due at `step` and not yet fired."""
        return any(i not in self.fired and f.ready_pool and f.step <= step for i, f in enumerate(self.faults))

    def pending(self, step: int) -> bool:
        """Whether a fault may meet `step` (not yet fired; its own step, or one that waits for a ready pool worker; a
        degrading rank's death): such a step is not sent ahead, so a fault is never spent on a step that a failure
        before it discards, and a drain before a death is not one step late."""
        return any(
            i not in self.fired
            and f.kind != "link"
            and (f.step == step or f.ready_pool and f.step < step)
            or f.until == step  # a degrading rank dies then: its node may be drained first, at the boundary before
            for i, f in enumerate(self.faults)
        )

    def link(self, step: int) -> dict | None:
        """The simulated link in force at `step` (1-based), for every rank: the last link fault whose step has come.
        It is recorded once, as it first applies."""
        links = [(i, f) for i, f in enumerate(self.faults) if f.kind == "link" and f.step <= step]
        if not links:
            return None
        i, f = max(links, key=lambda x: (x[1].step, x[0]))
        if i not in self.fired:
            self.fired.add(i)
            self.record(FaultFired(step, f.model_dump()))
        return {"gbps": f.gbps, "latency_ms": f.latency_ms}

    def readings(self, step: int, node_of: dict[int, str]) -> list[Reading]:
        """What the nodes of ecc faults report after `step`: single-bit errors from the fault's step on, at a rate
        that grows by `factor` each step, and an uncorrectable error (Xid 48) `warning` steps before `until`. Each
        fault stays with the node its rank was on when it began (`node_of`: rank -> node now)."""
        out = []
        for i, f in enumerate(self.faults):
            if f.kind != "ecc" or step < f.step:
                continue
            node = self.bound.setdefault(i, node_of.get(f.rank))
            k = step - f.step + 1
            broken = step >= f.until - f.warning
            out.append(
                Reading(
                    node,
                    time.time(),
                    "synthetic",
                    synthetic=True,
                    xid=[48] if step == f.until - f.warning else [],
                    ecc_sbe=int(f.factor * k * (k + 1) / 2),
                    ecc_dbe=int(broken),
                )
            )
        return out


def _same(fault: dict, recorded: dict) -> bool:
    return all(fault.get(k) == v for k, v in recorded.items()) and all(
        k in recorded or v == Fault.model_fields[k].default for k, v in fault.items()
    )


class ScriptedTelemetry:
    """A drill's telemetry (health.script): readings from a JSONL file, each after its `step`, for the node its
    `rank` was on at that rank's first row. Labelled synthetic."""

    def __init__(self, path: str):
        self.rows = read_script(path)
        self.bound: dict[int, str | None] = {}

    def readings(self, step: int, node_of: dict[int, str]) -> list[Reading]:
        out = []
        for row in self.rows.get(step, []):
            node = self.bound.setdefault(row["rank"], node_of.get(row["rank"]))
            values = {k: v for k, v in row.items() if k in READING_FIELDS}
            out.append(Reading(node, time.time(), "script", synthetic=True, **values))
        return out
