"""The coordinator's decisions, without Ray."""

import pytest

from actors.control import Observation, State, next_state


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
        (State.FINISHED, obs(lost=1), State.FINISHED),
        (State.FAILED, obs(), State.FAILED),
    ],
)
def test_next_state(state, o, expected):
    assert next_state(state, o) == expected


def test_every_live_state_can_reach_finished():
    for state in (State.STARTING, State.RUNNING, State.RESIZING, State.RECOVERING, State.CHECKPOINTING):
        assert next_state(state, obs(step=10)) == State.FINISHED
