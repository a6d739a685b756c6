"""What a worker and the coordinator's side hand each other, and the only module of the worker the control plane
imports besides its `spawn` (tests/test_layers.py): a worker's report of its part of a step. No Ray, no torch:
the engines that fill it run without either (bench/gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter


@dataclass
class StepReport:
    """One worker's part of a step (an engine's `step`: engine.py, rollout.py)."""

    finite: bool  # every rank holds the same synchronised gradient, so every rank says the same
    skipped: bool  # above the outlier guard's limit: the update was skipped
    loss: float  # this worker's share of the step's mean loss
    grad_norm: float
    lr: float
    share: int  # samples of the step's batch this worker took
    compute_s: float  # forward and backward up to the last gradient bucket: no waiting on peers
    communication_s: float  # the all-reduce time not hidden behind the backward pass
    worker_s: float
    comm_bytes: int
    dense_bytes: int
    optimizer_bytes: int  # this rank's optimizer state
    param_bytes: int  # this rank's parameters: its shards of a sharded model's
    peak_rss: int  # the worker process's peak resident memory so far, in bytes
    data: dict  # hits, misses, wait_s
    saving: bool = False  # a checkpoint part is still being written (the actor's to say)
    update_s: float = 0.0  # clipping and the optimizer's step
    ppo: dict | None = None  # a PPO step's sums over this worker's rollouts (etrain/worker/rollout.py)

    def __reduce__(self):
        """Pickled as its values in field order, not as a dataclass's attribute dict: read back in a third of the
        time, where a coordinator reads 1,024 reports a step at 1,024 workers (bench/scale.py)."""
        return StepReport, _VALUES(self)


_VALUES = attrgetter(*(f.name for f in fields(StepReport)))
