"""control/gather.py on real actors (no torch): the answers in the order asked, however they arrive; a failure
among them named, the dead told apart from the live."""

from __future__ import annotations

import time

import pytest
import ray

from etrain.control.control import JobError
from etrain.control.gather import WorkersLost, gather

pytestmark = pytest.mark.usefixtures("ray_session")


@ray.remote(num_cpus=0)
class Member:
    def answer(self, value: int, delay: float, fail: bool = False) -> int:
        time.sleep(delay)
        if fail:
            raise ValueError(f"member {value} failed")
        return value

    def info(self) -> dict:
        return {}

    def release(self) -> bool:
        return False


def dead_by(actor, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            ray.get(actor.info.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers")


def test_answers_come_back_in_the_order_asked_and_a_failure_is_named(rng):
    members = [Member.remote() for _ in range(12)]
    retired = []
    try:
        delays = [rng.random() * 0.05 for _ in members]
        refs = [m.answer.remote(i, d) for i, (m, d) in enumerate(zip(members, delays))]
        assert gather(refs, members, "a step", 30, 5, retired.extend) == list(range(12))

        bad = rng.randrange(12)
        print(f"member {bad} fails")
        refs = [m.answer.remote(i, d, i == bad) for i, (m, d) in enumerate(zip(members, delays))]
        with pytest.raises(JobError, match=f"a step failed on live workers.*member {bad} failed"):
            gather(refs, members, "a step", 30, 5, retired.extend)
        assert retired == []

        dead = rng.randrange(12)
        ray.kill(members[dead])
        dead_by(members[dead], time.monotonic() + 30)  # a call sent before the kill lands would still be answered
        refs = [m.answer.remote(i, 0.0) for i, m in enumerate(members)]
        with pytest.raises(WorkersLost) as lost:
            gather(refs, members, "a step", 30, 5, retired.extend)
        assert lost.value.lost == [members[dead]] == retired
        assert lost.value.finished[dead] is False
    finally:
        for m in members:
            ray.kill(m)
