"""A node's failure risk, with its reasons, from its telemetry and from its ranks' speed against their peers.

Rules for what precedes a failure (an Xid of that class, an uncorrectable ECC error, a failed row remap): risk 1,
drain now. Trends for the soft signals (single-bit ECC errors at a rising rate, heat with throttling, host memory
running out, a rank slower than its peers beyond its own noise): each must hold for several readings in a row,
because a node that is merely noisy must not be drained (a false positive costs capacity). Pure: readings and
speeds in, `Risk` out; etrain/control/health_watch.py acts on it.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from etrain.core.config import ConfigError, HealthConfig

# NVIDIA's Xid catalog: the events that precede a failure, or are one.
HARD_XIDS = {
    48: "double-bit ECC error",
    63: "ECC row remap or page retirement recorded",
    64: "ECC row remap failed",
    74: "NVLink error",
    79: "GPU fell off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
}
SOFT = 0.9  # a soft signal held for its full run scores this; a shorter run in proportion. Two together reach 0.99.


@dataclass
class Reading:
    """One telemetry reading of a node. Counters are cumulative, as NVML gives them; `xid` are the events since the
    last reading. `synthetic`: from a scripted source (tests, drills), never a device."""

    node: str
    t: float
    source: str
    synthetic: bool = False
    xid: list[int] = field(default_factory=list)
    ecc_sbe: int | None = None  # corrected (single-bit) ECC errors
    ecc_dbe: int | None = None  # uncorrected (double-bit) ECC errors
    remap_failure: bool | None = None
    temperature_c: float | None = None
    throttle_thermal: bool | None = None
    power_w: float | None = None
    pcie_replays: int | None = None
    mem_available: float | None = None  # share of host memory available
    swap_used: float | None = None  # share of swap in use


READING_FIELDS = set(Reading.__dataclass_fields__) - {"node", "t", "source", "synthetic"}


def read_script(path: str, ranks: int | None = None) -> dict[int, list[dict]]:
    """A drill's telemetry file (health.script): step -> its rows, each with `rank` and Reading fields. Every value is
    checked (a step from 1, a rank of the run's `ranks`, each field of Reading's type): a bad line is refused naming
    it, before the run starts, not met as a crash at its step."""
    rows: dict[int, list[dict]] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        why = f"cannot be read ({e.strerror}): give a JSONL file of readings"
        raise ConfigError(f"health.script={path!r} {why}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, parse_constant=_not_a_number)
        except json.JSONDecodeError as e:
            raise ConfigError(f"health.script {path}, line {n}: not JSON ({e.msg})") from None
        except ValueError as e:
            raise ConfigError(f"health.script {path}, line {n}: {e}") from None
        keys = set(row) if isinstance(row, dict) else set()
        if not {"step", "rank"} <= keys or keys - READING_FIELDS - {"step", "rank"}:
            raise ConfigError(
                f"health.script {path}, line {n}: a reading needs `step` and `rank`, and may have "
                f"{', '.join(sorted(READING_FIELDS))}; got {sorted(row) if isinstance(row, dict) else row!r}"
            )
        _check_row(row, ranks, f"health.script {path}, line {n}")
        rows.setdefault(row["step"], []).append(row)
    return rows


def _not_a_number(name: str):
    """json.loads takes NaN and Infinity; a reading of a sensor never is one, and a risk model fed one says nothing."""
    raise ValueError(f"{name} is not a reading: every value must be finite")


def _check_row(row: dict, ranks: int | None, where: str) -> None:
    import typing

    from pydantic import TypeAdapter, ValidationError

    step, rank = row["step"], row["rank"]
    if type(step) is not int or step < 1:
        raise ConfigError(f"{where}: `step` must be a step number from 1, got {step!r}")
    if type(rank) is not int or rank < 0 or (ranks is not None and rank >= ranks):
        most = f" of this run's ranks 0-{ranks - 1}" if ranks is not None else ""
        raise ConfigError(f"{where}: `rank` must be one{most}, got {rank!r}")
    types = typing.get_type_hints(Reading)
    for key in row.keys() & READING_FIELDS:  # Reading's own annotations, strictly: 79 is no list of Xids
        try:
            TypeAdapter(types[key]).validate_python(row[key], strict=True)
        except ValidationError as e:
            said = e.errors()[0]["msg"]
            raise ConfigError(f"{where}: `{key}` {said[0].lower()}{said[1:]} (got {row[key]!r})") from None


@dataclass
class Risk:
    score: float
    reasons: list[str]
    hard: bool  # a rule fired: drain now, even without a replacement ready (down to cluster.min_workers)
    synthetic: bool


class Streak:
    """How many readings in a row a condition has held."""

    def __init__(self):
        self.runs: dict[str, int] = {}

    def see(self, name: str, holds: bool) -> int:
        self.runs[name] = self.runs.get(name, 0) + 1 if holds else 0
        return self.runs[name]


class NodeHealth:
    """One node's telemetry over time: the last reading of each source, and the streaks of its soft signals."""

    def __init__(self, cfg: HealthConfig):
        self.cfg = cfg
        self.last: dict[str, Reading] = {}
        self.streak = Streak()
        self.events: list[str] = []  # hard reasons seen since the node was last assessed
        self.soft: dict[str, tuple[float, str]] = {}  # signal -> (score, reason) as of the last reading
        self.synthetic = False

    def add(self, r: Reading) -> None:
        prev, c = self.last.get(r.source), self.cfg
        self.last[r.source] = r
        self.synthetic |= r.synthetic
        self.events += [f"xid {x} ({HARD_XIDS[x]})" for x in r.xid if x in HARD_XIDS]
        if prev is not None and r.ecc_dbe is not None and prev.ecc_dbe is not None and r.ecc_dbe > prev.ecc_dbe:
            self.events.append(f"{r.ecc_dbe - prev.ecc_dbe} uncorrectable ECC error(s)")
        if r.remap_failure:
            self.events.append("a row remap failed")
        if prev is not None and r.ecc_sbe is not None and prev.ecc_sbe is not None and r.t > prev.t:
            rate = (r.ecc_sbe - prev.ecc_sbe) / (r.t - prev.t) * 60
            self._trend("ecc_sbe", rate >= c.sbe_per_min, f"single-bit ECC errors at {rate:.0f}/min")
        if r.temperature_c is not None:
            hot = r.temperature_c >= c.hot_c and bool(r.throttle_thermal)
            self._trend("heat", hot, f"{r.temperature_c:.0f} °C and throttling for heat")
        if r.mem_available is not None:
            low = r.mem_available < c.mem_available_min
            self._trend("memory", low, f"host memory {r.mem_available:.0%} available")

    def _trend(self, name: str, holds: bool, reason: str) -> None:
        run = self.streak.see(name, holds)
        if run:
            self.soft[name] = (SOFT * min(1.0, run / self.cfg.persist), f"{reason}, {run} reading(s) in a row")
        else:
            self.soft.pop(name, None)


class Drift:
    """Each rank's speed against its peers, step by step: log(speed / the median of the others'). A rank drifts when
    the median of its last `drift_steps` ratios lies below −drift_sigma × its noise, the noise measured from its
    step-to-step differences over its last 10 × drift_steps steps (a steady slide has small differences; a noisy
    node has large ones), never below drift_floor."""

    def __init__(self, cfg: HealthConfig):
        self.cfg = cfg
        self.ratios: dict[object, deque] = {}

    def observe(self, workers: list, speeds: list[float]) -> None:
        if len(workers) < 2:
            return
        for w, s, others in zip(workers, speeds, medians_of_others(speeds)):
            if s > 0 and others > 0:
                if (ratios := self.ratios.get(w)) is None:  # not setdefault: a deque made for each rank, each step
                    ratios = self.ratios[w] = deque(maxlen=10 * self.cfg.drift_steps)
                ratios.append(math.log(s / others))

    def forget(self, keep: set) -> None:
        if not self.ratios.keys() <= keep:  # most steps no one left: not rebuilt (1,024 ranks a step)
            self.ratios = {w: r for w, r in self.ratios.items() if w in keep}

    def assess(self, worker) -> tuple[float, str] | None:
        n, sigma, ratios = self.cfg.drift_steps, self.cfg.drift_sigma, self.ratios.get(worker, ())
        if len(ratios) < 3 * n:  # the noise needs some history: a rank is judged from its 3 × drift_steps-th step
            return None
        recent = statistics.median(itertools.islice(reversed(ratios), n))
        if recent > -sigma * self.cfg.drift_floor:  # within the least noise there is: no need to measure it (most
            return None  # ranks, every step: its median over 10 × drift_steps steps, 1,024 times a step)
        r = list(ratios)
        noise = max(self.cfg.drift_floor, statistics.median(abs(b - a) for a, b in zip(r, r[1:])) * 1.4826)
        if recent > -sigma * noise:
            return None
        return SOFT, f"{1 - math.exp(recent):.0%} slower than its peers for {n} steps (noise {noise:.2f})"


def medians_of_others(values: list[float]) -> list[float]:
    """For each value, statistics.median of all the others, from one sort: a median per rank over its peers was
    O(N²) a step, 27 ms at 1,024 ranks (bench/scale.py). The others of the value at sorted position r are the sorted
    values without position r, so their middle one(s) are read around r (in numpy: a Python loop over 1,024 ranks
    was another millisecond a step)."""
    v = np.asarray(values, dtype=float)
    order = np.argsort(v, kind="stable")
    ranked, rank = v[order], np.empty(len(v), dtype=np.intp)
    rank[order] = np.arange(len(v))
    m = len(v) - 1  # how many others

    def other(j: int) -> np.ndarray:  # the j-th smallest of the others of each value
        return np.where(j < rank, ranked[j], ranked[j + 1])

    return (other(m // 2) if m % 2 else (other(m // 2 - 1) + other(m // 2)) / 2).tolist()


def combine(hard: list[str], soft: list[tuple[float, str]], synthetic: bool) -> Risk:
    """1 if a rule fired; otherwise the chance that at least one soft signal is real, each taken as independent."""
    if hard:
        return Risk(1.0, hard, True, synthetic)
    keep = 1.0
    for score, _ in soft:
        keep *= 1 - score
    return Risk(round(1 - keep, 3), [reason for _, reason in soft], False, synthetic)
