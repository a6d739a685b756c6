"""The coordinator's control plane: an explicit state enum and a pure transition function.

Ray Train v2's controller is the model: the loop observes, `next_state` decides,
a handler per state acts. Deciding is pure, so every path (failure, resize,
checkpoint, give-up) is unit-tested without Ray.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from etrain.core.errors import Failure


class JobError(Failure):
    """Training cannot go on; the message says why and what to do."""


class State(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"  # the next step runs at the current membership
    RESIZING = "resizing"  # a step boundary where workers join or leave
    RECOVERING = "recovering"  # a step failed: replace the lost workers, re-form, redo the step
    EVALUATING = "evaluating"  # the held-out loss of the weights just committed
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
    evaluation_due: bool = False
    checkpoint_due: bool = False
    draining: int = 0  # members on draining nodes (preempted, or at risk): they leave at this boundary
    outer_step: bool = True  # the last step ended a window (DiLoCo): a resize waits for one unless a node drains
    in_flight: bool = False  # the next step was sent already (etrain/control/step.py): it runs before anything else


def next_state(state: State, obs: Observation) -> State:
    if state in (State.FINISHED, State.FAILED):
        return state
    if obs.lost:
        return State.RECOVERING if obs.recoveries < obs.max_recoveries else State.FAILED
    if obs.in_flight:  # its workers are in it: a resize or a drain waits one step (nothing else can be due)
        return State.RUNNING
    if obs.evaluation_due:
        return State.EVALUATING
    if obs.checkpoint_due:
        return State.CHECKPOINTING
    if obs.step >= obs.total_steps:
        return State.FINISHED
    if obs.draining or (obs.target != obs.world and obs.outer_step):
        return State.RESIZING
    return State.RUNNING


def due(step: int, every: int, total: int, window: int = 1) -> bool:
    """Whether a periodic act (an evaluation, a full checkpoint) is due after `step`: every `every`
    steps (0: never), and always after the last step. With `window` > 1 (DiLoCo's inner steps, config `window`)
    one that falls due inside a window waits for its end, where the workers hold one model."""
    if step % window and step != total:
        return False
    return any(s == total or (every > 0 and s % every == 0) for s in range(step - (step - 1) % window, step + 1))


def autoscale(world: int, free_slots: int, ready: int, idle: int, max_workers: int, warm_pool: int) -> int:
    """The autoscaling policy's world size: grow by ready (warm) pool workers, up to max_workers. It never
    shrinks a job: scale-in is asked for (`etrain scale`) or forced (a preemption notice drains a node).

    The first `warm_pool` ready workers are the reserve for failures: one of them joins only where the
    pool can be made whole again, by a free slot (room for a worker beyond the pool) or by a worker
    already starting beyond the reserve. Ready workers beyond the reserve (started for room the job can
    grow into) join as they are. A joiner is always warm, so growing costs seconds.
    """
    reserve = min(ready, warm_pool)
    beyond = ready - reserve
    starting_beyond = max(0, idle - warm_pool - beyond)  # each will take a joining reserve worker's place
    joinable = beyond + min(reserve, free_slots + starting_beyond)
    return max(world, min(max_workers, world + joinable))


def pool_size(world: int, wanted: int, free_slots: int, idle: int, warm_pool: int, max_workers: int | None) -> int:
    """Workers the warm pool should hold: its reserve, the workers wanted beyond the group (asked for by
    hand), and, when autoscaling, one for every free slot the job can grow into (those already held
    beyond the reserve count: their slots are no longer free). Below max_workers the pool holds at least
    one worker: without room it waits as demand, so the autoscaler adds a node and the worker starts
    there the moment the node is up (the reserve does that when there is one)."""
    if max_workers is None:
        return warm_pool + max(0, wanted - world)
    grow = min(max(0, max_workers - world), max(0, idle - warm_pool) + free_slots)
    return max(warm_pool + grow, int(world < max_workers))
