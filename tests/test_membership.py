"""Membership decisions without Ray: a resize's plan, the warm pool's trim."""

from __future__ import annotations

import pytest

from actors.membership import plan_resize
from actors.pool import surplus

NODES = {"w0": "n0", "w1": "n1", "w2": "n1", "w3": "n2"}


@pytest.mark.parametrize(
    "workers, draining, target, keep, leaving, evicted, joining, reason",
    [
        (["w0", "w1"], set(), 3, ["w0", "w1"], [], [], 1, "scale-out"),
        (["w0", "w1", "w3"], set(), 1, ["w0"], ["w1", "w3"], [], 0, "scale-in"),  # the lowest ranks stay
        (
            ["w0", "w1", "w2", "w3"],
            {"n1"},
            4,
            ["w0", "w3"],
            [],
            ["w1", "w2"],
            2,
            "preemption",
        ),  # replaced from the pool
        (["w0", "w1", "w2", "w3"], {"n1"}, 1, ["w0"], ["w3"], ["w1", "w2"], 0, "preemption"),
        (["w1"], {"n1"}, 1, [], [], ["w1"], 1, "preemption"),  # the only member's node goes: a ready worker replaces it
    ],
)
def test_plan_resize(workers, draining, target, keep, leaving, evicted, joining, reason):
    plan = plan_resize(workers, NODES, draining, target)
    assert (plan.keep, plan.leaving, plan.evicted, plan.joining, plan.reason) == (
        keep,
        leaving,
        evicted,
        joining,
        reason,
    )


def test_the_pool_is_trimmed_of_workers_still_starting_first():
    """Leavers given back are warm and attached: they stay, ahead of workers still starting (issue 15, defect 1:
    the trim kept `warm_pool` workers and stopped the one a scale-out was about to take)."""
    idle = ["leaver", "ready", "starting"]
    assert surplus(idle, warming={"starting"}, keep=2) == ["starting"]
    assert surplus(idle, warming={"starting"}, keep=3) == []
    assert surplus(idle, warming=set(), keep=1) == ["ready", "starting"]
