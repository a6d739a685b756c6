"""Failures, injected (faults: drills and tests) and foreseen (health: predictive maintenance)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from etrain.core.config.base import Section


class Fault(Section):
    """Failure injection for tests and drills (control/faults.py): at `step` (1-based), worker `rank` dies (before its
    step, or inside the gradient all-reduce), hangs, slows down, computes a NaN loss, or a loss `factor` times too
    large. Three scenarios of a node that fails slowly (predictive maintenance, docs/elastic.md): `degrade`
    (its compute slows a little more each step, then it dies at `until`), `ecc` (its node reports single-bit ECC
    errors at a rising rate, then an uncorrectable one `warning` steps before it dies at `until`; the readings
    are synthetic and labelled so) and `noisy` (its compute time varies by up to `factor` times, every step, and
    it never fails: a node that must not be drained)."""

    rank: int = Field(ge=0)
    step: int = Field(ge=1)
    kind: Literal["kill", "kill_in_allreduce", "hang", "slow", "nan", "spike", "degrade", "ecc", "noisy", "link"] = (
        "kill"
    )
    factor: float = Field(
        2.0,
        ge=1,
        description="slow: compute takes this many times as long from `step` on (a straggler); degrade: "
        "compute takes 1 + (factor - 1) × (steps since `step`) times as long; noisy: up to this many times",
    )
    until: int | None = Field(None, ge=2, description="degrade, ecc: the step at which the rank's process dies")
    warning: int = Field(5, ge=0, description="ecc: steps between the uncorrectable error and the death")
    ready_pool: bool = Field(
        False,
        description="hold the fault from `step` until a warm-pool worker is ready: a drill of a recovery whose "
        "replacement is there (on a busy machine a pool worker may still be starting at `step`); the run's last "
        "step waits for one",
    )
    during: Literal["step", "eval"] = Field(
        "step",
        description="step: with the work of step `step`; eval: in the evaluation after step `step` (kill or hang)",
    )
    gbps: float | None = Field(
        None,
        gt=0,
        description="link: from `step` on, every rank's gradient collectives take the time a ring over a link of "
        "this many Gbit/s would need for the bytes they send (a simulation: etrain/worker/link.py); `rank` is ignored",
    )
    latency_ms: float = Field(0.0, ge=0, description="link: each hop of the ring adds this latency")

    @model_validator(mode="after")
    def _ends(self) -> Fault:
        if self.during == "eval" and (self.kind not in ("kill", "hang") or self.ready_pool):
            raise ValueError(f"a fault during an evaluation is a kill or a hang, without ready_pool; got {self.kind}")
        if self.kind in ("degrade", "ecc") and (self.until is None or self.until <= self.step):
            raise ValueError(f"a {self.kind} fault needs `until`, the step it dies at, after `step`={self.step}")
        if self.kind not in ("degrade", "ecc") and self.until is not None:
            raise ValueError(f"`until` applies to degrade and ecc faults, not {self.kind}")
        if (self.kind == "link") != (self.gbps is not None):
            raise ValueError(
                "a link fault needs `gbps`, the simulated link's bandwidth"
                if self.kind == "link"
                else f"`gbps` applies to link faults, not {self.kind}"
            )
        return self


class HealthConfig(Section):
    """Predictive maintenance (control/health_watch.py): each node's failure risk from its telemetry and its ranks'
    speed, and a drain of a node at risk at a step boundary, onto ready warm-pool workers elsewhere."""

    action: Literal["drain", "observe"] = Field(
        "drain", description="drain: move off a node whose risk reaches drain_at; observe: score and record only"
    )
    sources: list[Literal["nvml", "host"]] = Field(
        ["nvml", "host"],
        description="telemetry read on every node with workers: nvml (GPU: Xid, ECC, remapped rows, heat and "
        "throttling, PCIe replays), host (memory, swap); [] = the job's own signals only",
    )
    every_s: float = Field(5.0, gt=0, description="seconds between telemetry readings of a node")
    drain_at: float = Field(0.8, gt=0, le=1, description="a node's risk at which it is drained")
    persist: int = Field(3, ge=1, description="readings in a row a soft signal must hold to score in full")
    drift_steps: int = Field(8, ge=2, description="steps in a row a rank must run slower than its peers")
    drift_sigma: float = Field(
        4.0, gt=0, description="how far below its peers a rank's speed must be, in its own step-to-step noise"
    )
    drift_floor: float = Field(
        0.05, gt=0, description="the least noise assumed, as a log speed ratio (0.05: a rank 5% slower is noise)"
    )
    sbe_per_min: float = Field(10.0, gt=0, description="single-bit ECC errors per minute that count as rising")
    hot_c: float = Field(85.0, description="a GPU this hot and throttling for heat is a soft signal")
    mem_available_min: float = Field(
        0.05, ge=0, lt=1, description="host memory available below this share is a soft signal"
    )
    script: str | None = Field(
        None,
        description="a drill's telemetry: a JSONL file of readings, each with the `step` after which it is read and "
        "the `rank` whose node reports it (the node it is on at its first row), and any Reading field; replayed as "
        "synthetic readings",
    )
    cooldown_s: float = Field(600.0, ge=0, description="a drained node gets no new workers for this long")
    lemon_drains: int = Field(2, ge=1, description="a node drained this many times is listed as a lemon")
