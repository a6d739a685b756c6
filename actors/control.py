"""The coordinator's control plane: an explicit state enum and a pure transition function.

Ray Train v2's controller is the model: the loop observes, `next_state` decides,
a handler per state acts. Deciding is pure, so every path (failure, resize,
checkpoint, give-up) is unit-tested without Ray.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class JobError(RuntimeError):
    """Training cannot go on; the message says why and what to do."""


def why(error: BaseException) -> str:
    """A failure in one line: the failing exception's own last line, not Ray's wrapper around it (an
    actor that died in its constructor carries the constructor's exception in its message)."""
    cause = getattr(error, "cause", None) or error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if getattr(cause, "actor_init_failed", False):
        return last[:300]
    return f"{type(cause).__name__}: {last}"[:300]


class State(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"  # the next step runs at the current membership
    RESIZING = "resizing"  # a step boundary where workers join or leave
    RECOVERING = "recovering"  # a step failed: replace the lost workers, re-form, redo the step
    CHECKPOINTING = "checkpointing"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True)
class Observation:
    """What the coordinator knows at a step boundary."""

    step: int
    total_steps: int
    world: int
    target: int  # the world size wanted (manual request or autoscaling policy)
    lost: int = 0  # workers lost in the last step
    recoveries: int = 0  # recoveries so far
    max_recoveries: int = 3
    checkpoint_due: bool = False
    evict: int = 0  # members on nodes being drained (a preemption notice): they leave at this boundary


def next_state(state: State, obs: Observation) -> State:
    if state in (State.FINISHED, State.FAILED):
        return state
    if obs.lost:
        return State.RECOVERING if obs.recoveries < obs.max_recoveries else State.FAILED
    if obs.checkpoint_due:
        return State.CHECKPOINTING
    if obs.step >= obs.total_steps:
        return State.FINISHED
    if obs.target != obs.world or obs.evict:
        return State.RESIZING
    return State.RUNNING


def autoscale(world: int, free_slots: int, ready: int, max_workers: int) -> int:
    """The autoscaling policy's world size: grow onto free worker slots, one ready (warm) pool
    worker per slot, up to max_workers. It never shrinks a job: scale-in is asked for
    (`etrain scale`) or forced (a preemption notice drains a node).

    A free slot is room for a worker beyond the warm pool, so the pool stays whole
    as a reserve for failures; a joiner must be ready, so growing costs seconds.
    """
    return max(world, min(max_workers, world + min(free_slots, ready)))
