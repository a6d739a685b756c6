"""The coordinator's decisions, without Ray."""

import pytest

from etrain.control.control import Observation, State, autoscale, next_state, pool_size


def obs(**kw) -> Observation:
    base = {"step": 5, "total_steps": 10, "world": 2, "target": 2}
    return Observation(**(base | kw))


@pytest.mark.parametrize(
    "state, o, expected",
    [
        (State.STARTING, obs(), State.RUNNING),
        (State.RUNNING, obs(), State.RUNNING),
        (State.RUNNING, obs(target=3), State.RESIZING),
        (State.RUNNING, obs(target=1), State.RESIZING),
        (State.RESIZING, obs(), State.RUNNING),
        (State.RUNNING, obs(lost=1), State.RECOVERING),
        (State.RUNNING, obs(lost=1, target=3), State.RECOVERING),  # recovery first, the resize after
        (State.RUNNING, obs(lost=1, recoveries=3, max_recoveries=3), State.FAILED),
        (State.RECOVERING, obs(), State.RUNNING),
        (State.RUNNING, obs(checkpoint_due=True), State.CHECKPOINTING),
        (State.RUNNING, obs(checkpoint_due=True, target=3), State.CHECKPOINTING),
        (State.CHECKPOINTING, obs(), State.RUNNING),
        (State.RUNNING, obs(step=10, checkpoint_due=True), State.CHECKPOINTING),  # the final checkpoint
        (State.CHECKPOINTING, obs(step=10), State.FINISHED),
        (State.RUNNING, obs(step=10, target=3), State.FINISHED),  # no resize after the last step
        (State.RUNNING, obs(draining=1), State.RESIZING),  # a node is being drained: move off it now
        (State.RUNNING, obs(draining=1, lost=1), State.RECOVERING),
        (State.RUNNING, obs(target=3, outer_step=False), State.RUNNING),  # DiLoCo: a resize waits for an outer step
        (State.RUNNING, obs(draining=1, outer_step=False), State.RESIZING),  # a drain does not: the window is redone
        (State.RUNNING, obs(in_flight=True, target=3), State.RUNNING),  # a step sent ahead runs before a resize
        (State.RUNNING, obs(in_flight=True, draining=1), State.RUNNING),  # and before a drain
        (State.RUNNING, obs(in_flight=True, lost=1), State.RECOVERING),  # (a failure discards it first)
        (State.FINISHED, obs(lost=1), State.FINISHED),
        (State.FAILED, obs(), State.FAILED),
    ],
)
def test_next_state(state, o, expected):
    assert next_state(state, o) == expected


def test_every_live_state_can_reach_finished():
    for state in set(State) - {State.FINISHED, State.FAILED}:
        assert next_state(state, obs(step=10)) == State.FINISHED, state


END = {State.FINISHED, State.FAILED}  # a job that ended stays ended, whatever is observed after


@pytest.mark.parametrize("state", list(State))
def test_only_an_ended_job_ignores_what_is_observed(state):
    """Every state: a live one goes where each observation leads (the last step: FINISHED; a lost worker:
    RECOVERING, or FAILED without recoveries left; ...), an ended one stays as it is."""
    leads = [
        (obs(step=10), State.FINISHED),
        (obs(), State.RUNNING),
        (obs(target=3), State.RESIZING),
        (obs(lost=1), State.RECOVERING),
        (obs(lost=1, recoveries=3), State.FAILED),
        (obs(evaluation_due=True), State.EVALUATING),
        (obs(checkpoint_due=True), State.CHECKPOINTING),
    ]
    assert {to for _, to in leads} == set(State) - {State.STARTING}  # every state a job can go to
    assert [next_state(state, o) for o, _ in leads] == [state if state in END else to for _, to in leads]


@pytest.mark.parametrize(
    "world, free, ready, idle, max_workers, warm_pool, expected",
    [
        (2, 0, 1, 1, 4, 1, 2),  # no room beyond the pool: the pool stays a reserve
        (2, 1, 0, 1, 4, 1, 2),  # room, but no warm worker yet: wait rather than join cold
        (2, 1, 1, 1, 4, 1, 3),
        (2, 3, 1, 1, 4, 1, 3),  # one ready worker, one join; the refilled pool brings the next
        (2, 5, 5, 5, 4, 1, 4),  # capped by max_workers
        (4, 2, 2, 2, 4, 1, 4),
        (5, 0, 0, 1, 4, 1, 5),  # above the cap (asked for by hand): never shrunk by the policy
        (1, 0, 1, 1, 2, 0, 2),  # no reserve: a worker started for the room joins once ready, room or not
        (1, 1, 0, 1, 2, 0, 1),  # ... but not before
        (2, 0, 2, 2, 4, 1, 3),  # beyond the reserve: joins; the reserve waits for room
        (1, 0, 1, 2, 2, 1, 2),  # the room is taken by a worker starting beyond the reserve: it will be the reserve
    ],
)
def test_autoscale(world, free, ready, idle, max_workers, warm_pool, expected):
    assert autoscale(world, free, ready, idle, max_workers, warm_pool) == expected


@pytest.mark.parametrize(
    "world, wanted, free, idle, warm_pool, max_workers, expected",
    [
        (2, 2, 0, 1, 1, None, 1),  # a fixed size: the reserve
        (2, 3, 0, 1, 1, None, 2),  # asked for one more by hand: it is started in the pool
        (1, 1, 2, 0, 0, 2, 1),  # no reserve, room on a new node: one worker to grow into it (cluster.max_workers=2)
        (1, 1, 0, 1, 0, 2, 1),  # ... it was started and holds its slot: still one, not another
        (2, 2, 3, 0, 0, 2, 0),  # at max_workers: nothing beyond
        (2, 2, 2, 1, 1, 8, 3),  # the reserve plus one per free slot
        (1, 1, 0, 0, 0, 2, 1),  # no room yet: one waits as demand for a node, and starts there when it comes
        (1, 1, 0, 1, 1, 2, 1),  # ... which the reserve is, when there is one
    ],
)
def test_pool_size(world, wanted, free, idle, warm_pool, max_workers, expected):
    assert pool_size(world, wanted, free, idle, warm_pool, max_workers) == expected
