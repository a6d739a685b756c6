"""The run directory's records: `metrics.jsonl` (one line per event, each a record below) and JSON files.

Every write is whole-file atomic or a single appended line, so a crash leaves
files that parse. The record kinds are the dataclasses here; each is built where
its event happens and written as a dict with its `kind` (docs/reference/records.md).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from etrain.core.config import Config

# The parts a step's wall time splits into (train records: `{part}_s`; the dashboard's `step_seconds{part}`; the
# report's plot), and the phases of a membership change (membership records: `phases`; the dashboard's scale latency).
STEP_PARTS = ("compute", "communication", "data_wait", "update", "dispatch", "other", "checkpoint_stall")
CHANGE_PHASES = ("detect", "acquire", "migrate", "reform", "first_step")
# ... and of a joiner's arrival before it, from its process's creation (membership records: `joined`)
JOIN_PHASES = ("process", "imports", "build", "warm_up", "attach", "wait")
# ... and of a run's start, from `etrain train` (or its API call) to its first committed step (start records)
START_PHASES = ("connect", "coordinator", "workers", "form", "load", "first_step")


@dataclass
class Record:
    kind: ClassVar[str]
    step: int

    def as_dict(self) -> dict:
        """The line written: its kind, its fields that have a value, the time. The fields as they are (their values
        are plain data, built for this record): `asdict`'s deep copy of a train record's per-rank lists took 6-10 ms
        a record at 1,024 workers, 0.01 ms without it (measured apart)."""
        values = ((f.name, getattr(self, f.name)) for f in fields(self))
        return {"kind": self.kind, **{k: v for k, v in values if v is not None}, "time": time.time()}


@dataclass
class Train(Record):
    """A committed step. Without `loss` (and the rest after it) when survivors of a lost worker committed it:
    their all-reduce held every share, but the lost worker's loss went with it."""

    kind: ClassVar[str] = "train"
    world_size: int
    batch: int
    cursor: int  # the data cursor after the step: samples taken from the global order so far
    replicas: int | None = None  # model replicas that ran it: world_size / (tp × pp × shard) of the layout then
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    skipped: bool | None = None  # the outlier guard skipped the update
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    worker_s: float | None = None
    mfu: float | None = None
    shares: list[int] | None = None
    speeds: list[float] | None = None
    comm_bytes: int | None = None
    dense_bytes: int | None = None
    optimizer_bytes: list[int] | None = None  # per rank
    param_bytes: list[int] | None = None  # per rank: its shards of a sharded model's
    peak_rss: list[int] | None = None  # per rank: its process's peak resident memory so far
    data_wait_s: float | None = None
    cache_hits: int | None = None
    cache_misses: int | None = None
    fetched_bytes: int | None = None
    fetched_shards: int | None = None
    compute_s: float | None = None
    communication_s: float | None = None
    update_s: float | None = None  # clipping and the optimizer's step
    dispatch_s: float | None = None  # the control path's share: the wall time beyond the slowest worker's own
    other_s: float | None = None
    sent_ahead: bool | None = None  # sent before the step before it came back (etrain/control/step.py)
    checkpoint_stall_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # mode-specific fields (parameter-server staleness)

    def as_dict(self) -> dict:
        d = super().as_dict()
        d.update(d.pop("extra"))
        return d


@dataclass
class Eval(Record):
    kind: ClassVar[str] = "eval"
    eval_loss: float
    eval_reward: float | None = None  # a PPO run's mean reward on held-out prompts
    eval_s: float | None = None  # its wall time (badput: etrain/core/goodput.py)


@dataclass
class Membership(Record):
    """A group change at a step boundary; `phases` (CHANGE_PHASES) in seconds, `total_s` their sum. With joiners,
    `joined`: the last one's start before the change (JOIN_PHASES, seconds; `joined_at`, its process's creation time).
    A new node's arrival to the first step at the new size: (`joined_at` - the node's arrival) + `joined` + `phases`."""

    kind: ClassVar[str] = "membership"
    reason: str  # start, scale-out, scale-in, recover, preemption, drain (etrain/control/health_watch.py)
    world_before: int
    world_after: int
    lost: int
    joiners: int
    joiner_nodes: list
    draining_nodes: list
    phases: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    joined: dict[str, float] | None = None
    joined_at: float | None = None


@dataclass
class Start(Record):
    """A run's start (or a resume's), from the driver's start to its first committed step: `phases` (START_PHASES) in
    seconds, `total_s` their sum. Written with that step, under the step the run started from (0, or the resume's):
    a rollback to an earlier checkpoint does not move it aside."""

    kind: ClassVar[str] = "start"
    phases: dict[str, float]
    total_s: float


@dataclass
class Autoscale(Record):
    kind: ClassVar[str] = "autoscale"
    world: int
    wanted: int


@dataclass
class Balance(Record):
    """The split switched between equal and by speed."""

    kind: ClassVar[str] = "balance"
    balanced: bool
    shares: list[int]


@dataclass
class Outlier(Record):
    """A step whose update the outlier guard skipped; its samples are in quarantine.jsonl."""

    kind: ClassVar[str] = "outlier"
    grad_norm: float
    limit: float
    batch: int
    guard_restarted: bool


@dataclass
class NanRollback(Record):
    kind: ClassVar[str] = "nan_rollback"
    to_step: int
    lr_scale: float


@dataclass
class Checkpoint(Record):
    kind: ClassVar[str] = "checkpoint"
    level: str
    path: str
    bytes: int
    stall_s: float
    save_s: float
    retain_error: str | None = None


@dataclass
class CheckpointFailed(Record):
    kind: ClassVar[str] = "checkpoint_failed"
    error: str


@dataclass
class Rewind:
    """The run went back to `step`: `kind` resume (a new driver), rollback (a lost ZeRO-1 shard, a NaN) or outer
    (DiLoCo: members changed between outer steps, and the window since the last one is redone)."""

    step: int
    kind: str  # resume, rollback or outer
    path: str | None
    level: str | None
    base: str | None
    reason: str
    reached_step: int
    records_redone: int
    load_s: float | None
    skipped: list[dict] | None = None  # newer committed checkpoints that failed verification: path, error

    def as_dict(self) -> dict:
        return {**asdict(self), "time": time.time()}


@dataclass
class Health(Record):
    """A node's risk changed level, or the job acted on it (control/health_watch.py). `action`: watch (risk at half of
    health.drain_at or more), clear (below again), wait (to be drained, no replacement ready yet), drain (its members
    leave at this step boundary), release (its cool-down is over), lemon (drained health.lemon_drains times)."""

    kind: ClassVar[str] = "health"
    node: str
    score: float
    reasons: list
    action: str
    synthetic: bool  # a reading came from a scripted source (a drill), not a device


@dataclass
class Warn(Record):
    kind: ClassVar[str] = "warning"
    text: str


@dataclass
class FaultFired(Record):
    """An injected fault (config `faults`) handed to its rank with the work of `step`: a drill shows in the run's
    history, and a resumed run does not inject it again."""

    kind: ClassVar[str] = "fault"
    fault: dict  # as configured: rank, step, kind and its parameters


@dataclass
class PSSummary(Record):
    """Parameter-server mode's shards at the end: updates, window closes, staleness seen."""

    kind: ClassVar[str] = "ps"
    shards: list[dict]


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(_renamed(json.loads(line)))
        except json.JSONDecodeError:
            continue  # a line torn by a crash mid-write
    return records


RENAMED = {("train", "samples"): "cursor", ("outlier", "samples"): "batch"}  # fields of older runs' records


def _renamed(row: dict) -> dict:
    """A record written before a field got its name, under that name: older run directories stay readable."""
    for (kind, old), new in RENAMED.items():
        if row.get("kind") == kind and old in row and new not in row:
            row[new] = row.pop(old)
    return row


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def truncate_after(path: Path, step: int) -> int:
    """Keep records up to `step` (a resume redoes the rest); move the others aside. Returns how many moved."""
    records = read_jsonl(path)
    keep = [r for r in records if r.get("step", 0) <= step]
    redone = [r for r in records if r.get("step", 0) > step]
    for r in redone:
        append_jsonl(path.with_name("metrics.redone.jsonl"), r)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)
    return len(redone)


def eta_s(commits: list[float], steps_left: int) -> float | None:
    """Seconds to the last step at the pace of the recent steps, from their commit times (None before two)."""
    if len(commits) < 2:
        return None
    return steps_left * (commits[-1] - commits[0]) / (len(commits) - 1)


def summarize(metrics_path: Path, cfg: Config, started_at: float, first_step_at: float | None) -> dict:
    """summary.json: what the run did, from its records."""
    records = read_jsonl(metrics_path)
    # A step committed by survivors of a lost worker has no complete loss: it counts, but is not averaged.
    steps = [r for r in records if r["kind"] == "train"]
    train = [r for r in steps if r.get("loss") is not None]
    evals = [r for r in records if r["kind"] == "eval"]
    seq = cfg.model.seq_len
    return {
        "steps": steps[-1]["step"] if steps else 0,
        "samples": steps[-1]["cursor"] if steps else 0,
        "tokens": (steps[-1]["cursor"] if steps else 0) * seq,
        "first_loss": train[0]["loss"] if train else None,
        "final_loss": train[-1]["loss"] if train else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "tokens_per_s": steady_tokens_per_s(steps),
        "wall_s": time.time() - started_at,
        "startup_s": first_step_at - started_at if first_step_at else None,
        "world_size": steps[-1]["world_size"] if steps else cfg.cluster.num_workers,
        "config_hash": cfg.hash(),
    }


def steady_tokens_per_s(train: list[dict]) -> float | None:
    """Tokens per second over the steps with every member's result, after the first (it pays for warm-up:
    allocations, gloo buffers): their tokens over their time."""
    done = [r for r in train if r.get("loss") is not None and r.get("step_time_s")]
    steady = done[1:] or done
    seconds = sum(r["step_time_s"] for r in steady)
    return sum(r["tokens_per_s"] * r["step_time_s"] for r in steady) / seconds if seconds else None
