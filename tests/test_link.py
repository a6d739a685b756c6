"""The simulated link (fault kind link), the step-time model behind the report's advice, and DiLoCo's windows on the
coordinator's side, without Ray."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from etrain.control.control import due
from etrain.control.faults import FaultPlan
from etrain.control.outer_steps import OuterSteps
from etrain.control.step import Position
from etrain.core.comm_model import advise, seconds, wire_bytes
from etrain.core.config import ConfigError, load_config
from etrain.data import order
from etrain.worker.link import Link


@pytest.mark.parametrize(
    "nbytes, world, gbps, latency_ms, collective, expected",
    [
        (10**9, 2, 1, 0, "allreduce", 8.0),  # 2(N-1)/N = 1: the whole buffer crosses the link once
        (10**9, 4, 1, 1, "allreduce", 12.0 + 6e-3),  # 1.5 x 8 s, and 6 hops of 1 ms
        (10**9, 4, 10, 0, "allgather", 2.4),  # 3 peers' 1 GB each at 10 Gbit/s
        (1234, 1, 0.1, 5, "allreduce", 0.0),  # alone: no link
    ],
)
def test_a_collectives_time_is_the_rings_formula(nbytes, world, gbps, latency_ms, collective, expected):
    assert seconds(nbytes, world, gbps, latency_ms, collective) == pytest.approx(expected)


def test_the_link_carries_one_collective_at_a_time_and_never_ends_one_early(rng):
    """Buckets handed over together queue on the link: each ends its own time after the one before; a future
    delayed to its booking completes no earlier than that (a lower bound: a slow machine only adds to it)."""
    gbps, latency = rng.choice([0.5, 1, 4]), rng.choice([0, 0.2, 1])
    sizes = [rng.randrange(10**4, 10**6) for _ in range(rng.randrange(2, 5))]
    world = rng.randrange(2, 5)
    print(f"{gbps} Gbit/s, {latency} ms, buckets {sizes}, world {world}")
    link = Link(gbps, latency)
    modelled = [seconds(n, world, gbps, latency) for n in sizes]
    started = time.perf_counter()
    first = link.book(sizes[0], world)
    booked = time.perf_counter()
    ends = [first] + [link.book(n, world) for n in sizes[1:]]
    assert all(b - a == pytest.approx(m, abs=1e-6) for a, b, m in zip(ends, ends[1:], modelled[1:]))
    assert started + modelled[0] <= first <= booked + modelled[0]  # the first starts when it is handed over
    real = torch.futures.Future()
    delayed = link.delay(real, ends[-1])
    real.set_result(torch.ones(3))
    assert torch.equal(delayed.wait(), torch.ones(3)) and time.perf_counter() >= ends[-1]
    failed = torch.futures.Future()
    relayed = link.delay(failed, 0.0)
    failed.set_exception(RuntimeError("peer gone"))
    with pytest.raises(RuntimeError, match="peer gone"):
        relayed.wait()


def test_a_link_fault_holds_for_every_rank_from_its_step_and_is_recorded_once():
    cfg = load_config(
        "tiny",
        [
            "faults=[{rank: 1, step: 3, kind: link, gbps: 1, latency_ms: 2}, "
            "{rank: 0, step: 6, kind: link, gbps: 0.5}, {rank: 1, step: 4, kind: kill}]"
        ],
    )
    recorded = []
    plan = FaultPlan(cfg.faults, recorded.append)
    links = [plan.link(s) for s in range(1, 9)]
    assert links == [None, None, *[{"gbps": 1, "latency_ms": 2}] * 3, *[{"gbps": 0.5, "latency_ms": 0}] * 3]
    assert plan.due(4) == {1: cfg.faults[2].model_dump()}  # the kill is its rank's, once; no link among them
    assert [(r.step, r.fault["kind"]) for r in recorded] == [(3, "link"), (6, "link"), (4, "kill")]
    # a resumed run's earlier record of the kill, written before faults had link keys: not fired again
    before = {k: v for k, v in cfg.faults[2].model_dump().items() if k not in ("gbps", "latency_ms")}
    assert FaultPlan(cfg.faults, recorded.append, [before]).due(4) == {}


def records(world: int, step_s: float, communication_s: float, sent: int, dense: int, n: int = 5) -> list[dict]:
    row = {"loss": 1.0, "world_size": world, "step_time_s": step_s, "communication_s": communication_s}
    return [row | {"step": s, "comm_bytes": sent * world, "dense_bytes": dense * world} for s in range(1, n + 1)]


def test_the_advice_follows_the_step_split_and_the_bytes():
    """A run whose steps are mostly communication is told so, and which mode would shorten them most, by the model's
    arithmetic; a run whose steps are compute is told nothing would pay; one worker gets no advice."""
    dense = 4 * 10**6
    slow = advise(records(2, 1.0, 0.8, dense, dense), topk_ratio=0.1, inner_steps=16)
    assert slow["bound"] and slow["share"] == pytest.approx(0.8)
    assert slow["modes"]["allreduce"] == pytest.approx(1.0)
    assert slow["modes"]["allreduce bf16"] == pytest.approx(0.2 + 0.4)
    assert slow["modes"]["diloco H=16"] == pytest.approx(0.2 + 0.8 / 16)
    assert slow["modes"]["topk ratio 0.1"] == pytest.approx(0.2 + 0.8 * wire_bytes(0.1 * dense, 2, "allgather") / dense)
    assert slow["best"] == "diloco H=16 bf16" and "it bounds this run" in slow["advice"]
    fast = advise(records(2, 1.0, 0.05, dense, dense))
    assert not fast["bound"] and "does not bound" in fast["advice"]
    assert advise(records(1, 1.0, 0.0, 0, dense)) is None
    # a DiLoCo run's bytes come once per window: the seconds per byte are its own
    diloco = advise(records(2, 0.3, 0.1, dense // 16, dense), inner_steps=16)
    assert diloco["modes"][f"diloco H={16}"] == pytest.approx(0.3)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_a_periodic_act_due_inside_a_window_waits_for_its_end(window):
    total = 50
    for every in (0, 4, 5, 7):
        for step in range(1, total + 1):
            at_end = step % window == 0 or step == total
            inside = range(step - (step - 1) % window, step + 1)
            want = at_end and any(s == total or (every and s % every == 0) for s in inside)
            assert due(step, every, total, window) == want, (step, every)
        fired = [s for s in range(1, total + 1) if due(s, every, total, window)]
        plain = [s for s in range(1, total + 1) if due(s, every, total)]
        assert all(any(p <= f for f in fired) for p in plain)  # none is lost: each comes at its window's end


def test_outer_rewinds_read_every_sample_once(rng):
    """Steps of a DiLoCo run, with members lost at random steps: each loss sends the run back to the last outer
    step (OuterSteps.start) and the window is read again; the committed steps read the global order exactly once."""
    window = rng.choice([2, 3, 5])
    cfg = load_config("tiny", ["comm.mode=diloco", f"comm.diloco.inner_steps={window}", "train.steps=60"])
    layout = order.Layout(seed=3, sizes=(40, 33, 51), block=2)
    outer, at, committed = OuterSteps(cfg), Position(), []
    while at.step < cfg.train.steps:
        if rng.random() < 0.15:  # a member lost before this step: back to the last outer step
            at = Position(outer.start.step, outer.start.cursor)
            del committed[at.step :]
        weights = [1.0] * rng.randrange(1, 4)
        committed.append(order.plan_step(layout, at.cursor, 16, weights))
        at.advance(16)
        outer.stepped(at)
        assert outer.start.step % window == 0 or outer.start.step == cfg.train.steps
    read = np.concatenate([ids for step in committed for ids in step])
    assert len(read) == at.cursor == 16 * cfg.train.steps
    assert np.array_equal(read, order.take(layout, 0, len(read)))


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (["faults=[{rank: 0, step: 2, kind: link, gbps: 0.00001}]"], True),  # ~23 min a step's all-reduce, step_s 3 min
        (
            ["faults=[{rank: 0, step: 2, kind: link, gbps: 0.00001}]", "comm.compression=bf16"]
            + ["timeouts.step_s=600", "timeouts.join_s=900"],  # bf16: half the bytes, ~11 min
            True,
        ),
        (
            ["faults=[{rank: 0, step: 2, kind: link, gbps: 0.00001}]", "timeouts.step_s=3000", "timeouts.join_s=3600"],
            False,
        ),
        (["faults=[{rank: 0, step: 2, kind: link, gbps: 1, latency_ms: 50000}]"], True),  # 2 buckets x 2 hops x 50 s
        (["faults=[{rank: 0, step: 2, kind: link, gbps: 0.01}]"], False),
    ],
)
def test_a_link_whose_modelled_step_outlasts_the_step_timeout_is_refused_naming_both(overrides, refused):
    """Issue 41, defect 6: such a link hung each step to timeouts.step_s, then ended the run as if every worker
    were lost. The ring model's time for a step's dense gradients at the run's largest world is held to the step
    timeout before anything starts."""
    if not refused:
        load_config("tiny", overrides)
        return
    with pytest.raises(ConfigError, match=r"a link of .* makes a step's gradient all-reduce .* timeouts\.step_s="):
        load_config("tiny", overrides)
