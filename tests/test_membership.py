"""Membership decisions without Ray: a resize's plan, the warm pool's trim."""

from __future__ import annotations

import pytest

from etrain.control.membership import plan_resize, twin, whole_replicas
from etrain.control.pool import surplus

NODES = {"w0": "n0", "w1": "n1", "w2": "n1", "w3": "n2"}


@pytest.mark.parametrize(
    "workers, preempted, target, keep, leaving, drained, joining, reason",
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
def test_plan_resize(workers, preempted, target, keep, leaving, drained, joining, reason):
    plan = plan_resize(workers, NODES, preempted, target)
    assert (plan.keep, plan.leaving, plan.drained, plan.joining, plan.reason) == (
        keep,
        leaving,
        drained,
        joining,
        reason,
    )


@pytest.mark.parametrize(
    "preempted, target, keep, leaving, drained, joining",
    [
        ({"n1"}, 4, ["w0", "w1"], ["w2"], ["w3"], 2),  # w3's node goes: its replica leaves whole, one comes back
        ({"n0"}, 2, ["w2", "w3"], ["w1"], ["w0"], 0),  # the first replica goes; the second takes ranks 0 and 1
        (set(), 2, ["w0", "w1"], ["w2", "w3"], [], 0),  # scale-in by a replica: the last one leaves
        (set(), 6, ["w0", "w1", "w2", "w3"], [], [], 2),  # scale-out by a replica
    ],
)
def test_a_layout_resizes_by_whole_replicas(preempted, target, keep, leaving, drained, joining):
    """Replicas of 2 ranks: [w0 w1] [w2 w3]."""
    nodes = {"w0": "n0", "w1": "n2", "w2": "n2", "w3": "n1"}
    plan = plan_resize(["w0", "w1", "w2", "w3"], nodes, preempted, target, ranks=2)
    assert (plan.keep, plan.leaving, plan.drained, plan.joining) == (keep, leaving, drained, joining)


def test_a_replica_that_lost_a_rank_is_out_whole_and_a_joiner_takes_its_twins_state():
    workers = ["a0", "a1", "b0", "b1", "c0", "c1"]
    assert whole_replicas(workers, ["b1"], 2) == (["a0", "a1", "c0", "c1"], ["b0", "b1"])
    # ranks 4 and 5 joined at step 7 holding nothing; ranks 0-3 hold step 7: each takes the rank at its place
    applied = [7, 7, 7, 7, -1, -1]
    assert [twin(r, applied, 7, 2) for r in (4, 5)] == [0, 1]
    assert twin(3, [7, -1, 7, -1], 7, 2) is None  # no live replica holds that place: nothing to copy from


def test_the_pool_is_trimmed_of_workers_still_starting_first():
    """Leavers given back are warm and attached: they stay, ahead of workers still starting (issue 15, defect 1:
    the trim kept `warm_pool` workers and stopped the one a scale-out was about to take)."""
    idle = ["leaver", "ready", "starting"]
    assert surplus(idle, warming={"starting"}, keep=2) == ["starting"]
    assert surplus(idle, warming={"starting"}, keep=3) == []
    assert surplus(idle, warming=set(), keep=1) == ["ready", "starting"]
