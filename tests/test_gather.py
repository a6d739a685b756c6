"""control/gather.py on real actors (no torch): the answers in the order asked, however they arrive; a failure
among them named, the dead told apart from the live."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import ray

from etrain.control.control import JobError
from etrain.control.data_plane import DataPlane
from etrain.control.gather import WorkersLost, gather
from etrain.control.relay import NodeRelay, Relays, key

pytestmark = pytest.mark.usefixtures("ray_session")


@ray.remote(num_cpus=0)
class Member:
    def answer(self, value: int, delay: float, fail: bool = False) -> int:
        time.sleep(delay)
        if fail:
            raise ValueError(f"member {value} failed")
        return value

    def step(self, n: int, work: dict, fault: dict | None = None) -> int:
        """What a node relay calls (TrainWorker.step's signature)."""
        return self.answer(work["value"], work["delay"], fault is not None)

    def info(self) -> dict:
        return {}

    def release(self) -> bool:
        return False

    def mark(self, value: int) -> None:
        """What a relay's `tell` calls: kept, for `marks`."""
        self.told = [*getattr(self, "told", []), value]

    def marks(self) -> list:
        return getattr(self, "told", [])


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


def test_through_node_relays_the_answers_come_back_by_rank_and_a_failure_is_named(rng):
    """Members spread over three relays at random (a relay's ranks need not be consecutive): the answers in rank
    order; a member that fails, or dies, fails the wait as its own answer would, its rank named by `finished`."""
    members = [Member.remote() for _ in range(10)]
    relays = [ray.remote(NodeRelay).options(num_cpus=0).remote() for _ in range(3)]
    retired = []
    try:
        placed = [rng.randrange(3) for _ in members]
        spans = [[r for r, p in enumerate(placed) if p == i] for i in range(3)]
        spans = [s for s in spans if s]
        print(f"ranks by relay: {spans}")
        delays = [rng.random() * 0.05 for _ in members]

        def step(n: int, generation: int, faults: dict, first: bool = False) -> list:
            return [
                relays[placed[span[0]]].step.remote(
                    n,
                    generation,
                    [key(members[r]) for r in span] if first else None,
                    [members[r] for r in span] if first else [],
                    [{"value": r, "delay": delays[r]} for r in span],
                    [faults.get(r) for r in span],
                )
                for span in spans
            ]

        assert gather(step(1, 1, {}, first=True), members, "step 1", 30, 5, retired.extend, spans=spans) == list(
            range(10)
        )
        bad = rng.randrange(10)
        print(f"member {bad} fails")
        with pytest.raises(JobError, match=f"step 2 failed on live workers.*member {bad} failed"):
            gather(step(2, 1, {bad: {"kind": "raise"}}), members, "step 2", 30, 5, retired.extend, spans=spans)
        assert retired == []
        for ref in step(3, 2, {}):  # a group the relays were not sent
            with pytest.raises(ray.exceptions.RayTaskError, match="holds the members of group 1, not of group 2"):
                ray.get(ref)

        dead = rng.randrange(10)
        ray.kill(members[dead])
        dead_by(members[dead], time.monotonic() + 30)
        with pytest.raises(WorkersLost) as lost:
            gather(step(4, 1, {}), members, "step 4", 30, 5, retired.extend, spans=spans)
        assert lost.value.lost == [members[dead]] == retired
        assert len(lost.value.finished) == 10 and lost.value.finished[dead] is False
    finally:
        for actor in members + relays:
            ray.kill(actor)


PING_S = 3.0  # the live answer a ping well within it on any machine; the busy one never does


def test_a_member_changes_calls_pings_and_stops_go_through_the_relays_each_handle_sent_once(rng):
    """Relays.call, ping and tell (a member change's calls, a failure's pings, a failed step's stop) over members
    spread at random over three relays: results in rank order, a failure named, a handle sent to its relay once; the
    dead, the silent (busy in a long call) and the alive told apart, the members of a relay that is gone pinged
    directly; a gather's failure pinged through the relays names the dead."""
    members = [Member.remote() for _ in range(10)]
    relays = Relays()
    relays.actors = {f"node-{i}": ray.remote(NodeRelay).options(num_cpus=0).remote() for i in range(3)}
    retired = []
    try:
        nodes = [f"node-{rng.randrange(3)}" for _ in members]
        print(f"nodes by rank: {nodes}")
        assert relays.covers(nodes) and not relays.covers([*nodes, "node-9"])

        def ask(method: str, args: list, what: str = "a call") -> list:
            refs, spans = relays.call(method, members, nodes, args)
            return gather(refs, members, what, 30, 5, retired.extend, spans=spans, pings=ping_through)

        def ping_through(workers: list, timeout: float):
            return relays.ping(workers, [nodes[members.index(w)] for w in workers], timeout)

        delays = [rng.random() * 0.05 for _ in members]
        assert ask("answer", [(r, delays[r]) for r in range(10)]) == list(range(10))
        assert {n: len(s) for n, s in relays.sent.items()} == {n: nodes.count(n) for n in set(nodes)}
        assert relays._named(nodes[0], [members[0]])[1] == []  # sent once: named by its id after that
        bad = rng.randrange(10)
        print(f"member {bad} fails")
        with pytest.raises(JobError, match=f"a call failed on live workers.*member {bad} failed"):
            ask("answer", [(r, delays[r], r == bad) for r in range(10)])

        value = rng.randrange(1000)
        relays.tell("mark", members, nodes, (value,))
        deadline = time.monotonic() + 30  # not waited for: the relays' calls land a moment later
        while (told := ray.get([m.marks.remote() for m in members])) != [[value]] * 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert told == [[value]] * 10

        dead, busy = rng.sample(range(10), 2)
        print(f"member {dead} killed, member {busy} busy")
        ray.kill(members[dead])
        dead_by(members[dead], time.monotonic() + 30)
        members[busy].answer.remote(busy, 60.0)
        assert relays.ping(members, nodes, PING_S) == ([members[dead]], [members[busy]])
        gone = next(n for n in relays.actors if n in nodes)
        ray.kill(relays.actors[gone])
        # the killed relay's members pinged directly: the same verdicts
        assert relays.ping(members, nodes, PING_S) == ([members[dead]], [members[busy]])
        del relays.actors[gone]
        relays.actors[gone] = ray.remote(NodeRelay).options(num_cpus=0).remote()
        relays.sent.pop(gone)  # a new relay holds no handle yet (Relays._start)
        with pytest.raises(WorkersLost) as lost:
            ask("info", [()] * 10, "group exit")
        # in rank order; the busy one is not released (it waits in no rendezvous)
        assert lost.value.lost == [members[r] for r in sorted((dead, busy))] == retired
    finally:
        for actor in members + list(relays.actors.values()):
            ray.kill(actor)


@ray.remote(num_cpus=0)
class Reporter:
    """A member whose answer carries a `data` dict, as a StepReport does."""

    def step(self, n: int, work: dict, fault: dict | None = None):
        return SimpleNamespace(value=work["value"], data={"hits": 1, "misses": 0, "wait_s": 0.0})


@ray.remote(num_cpus=0, max_concurrency=4)
class Counts:
    """A node's shard cache as the relay asks it: its totals so far; a gated one answers once opened."""

    def __init__(self, gated: bool = False):
        self.gate, self.fetched, self.released = threading.Event(), 0, []
        if not gated:
            self.gate.set()

    def open(self) -> None:
        self.gate.set()

    def info(self) -> dict:
        return {}

    def stats(self) -> dict:
        self.gate.wait()
        self.fetched += 1
        return {"fetched_bytes": 100 * self.fetched, "fetched_shards": self.fetched, "cached": [0], "pinned": []}

    def release_holder(self, holder: str) -> None:
        self.released.append(holder)  # one call at a time or not (4 threads): an append is never lost

    def holders_released(self) -> list:
        return list(self.released)


def test_a_relay_brings_its_node_caches_counts_without_waiting_for_them(rng):
    """The relay asks its node's cache with a step and gives the answer back with the first step that ends after it
    is in, one question at a time (the counts are totals: none is lost, none waited for); DataPlane.cost reads them
    in place of asking that cache itself, and drops a dead one (the next watch starts another). A stopped worker's
    pins are released in its node's cache alone (DataPlane.release), in every cache where its node is unknown."""
    members = [Reporter.remote() for _ in range(rng.randrange(1, 5))]
    cache, gated, other = Counts.remote(), Counts.remote(gated=True), Counts.remote()
    relay = ray.remote(NodeRelay).options(num_cpus=0).remote()
    n = iter(range(1, 10_000))
    try:
        ray.get([cache.info.remote(), gated.info.remote()])
        works, faults = [{"value": i} for i in range(len(members))], [None] * len(members)

        def counts(cache_sent=None, handles=None) -> dict | None:
            ids = [key(h) for h in handles] if handles else None
            answer = ray.get(relay.step.remote(next(n), 1, ids, handles or [], works, faults, cache_sent))
            assert [r.value for r in answer.results] == list(range(len(members)))
            assert all("cache" not in r.data for r in answer.results[1:])
            return answer.results[0].data.get("cache")

        def next_counts(cache_sent=None) -> dict:
            for _ in range(200):
                if (c := counts(cache_sent)) is not None:
                    return c
                cache_sent = None
                time.sleep(0.05)
            raise AssertionError("no counts in 200 steps")

        assert counts(handles=members) is None  # no cache sent yet: nothing asked
        assert next_counts(("node-a", cache)) == {"node": "node-a", "fetched_bytes": 100, "fetched_shards": 1}
        assert next_counts() == {"node": "node-a", "fetched_bytes": 200, "fetched_shards": 2}  # one at a time
        assert all(counts(("node-a", gated) if i == 0 else None) is None for i in range(5))  # not waited for
        gated.open.remote()
        assert next_counts() == {"node": "node-a", "fetched_bytes": 100, "fetched_shards": 1}  # asked once in 5 steps
        ray.kill(cache)
        dead_by(cache, time.monotonic() + 30)
        assert next_counts(("node-a", cache)) == {"node": "node-a", "gone": True}

        plane = DataPlane.__new__(DataPlane)  # the part of the data plane a step's cost needs
        plane.caches, plane._fetched = {"node-a": cache, "node-b": gated}, {}
        seen = [{"hits": 2, "misses": 1, "wait_s": 0.5, "cache": {"node": "node-a", "fetched_bytes": 300,
                 "fetched_shards": 3}}, {"hits": 1, "misses": 0, "wait_s": 0.1}]  # fmt: skip
        expected = {"data_wait_s": 0.5, "cache_hits": 3, "cache_misses": 1, "fetched_bytes": 300, "fetched_shards": 3}
        # node-b's asked here, its second answer (200 bytes, 2 shards: the relay had its first)
        assert plane.cost(seen) == expected | {"fetched_bytes": 500, "fetched_shards": 5}
        seen[0]["cache"] = {"node": "node-a", "fetched_bytes": 500, "fetched_shards": 4}
        assert plane.cost(seen)["fetched_bytes"] == 200 + 100  # what each fetched since
        seen[0]["cache"] = {"node": "node-a", "gone": True}
        assert plane.cost(seen)["fetched_shards"] == 1 and set(plane.caches) == {"node-b"}

        # a stopped worker's pins: in its node's cache only, in every cache where its node is not known
        plane.caches, plane.attached = {"node-b": gated, "node-c": other}, set(members)
        expected = {"node-b": [], "node-c": []}
        for worker, node in zip(members, rng.choices(["node-b", "node-c", None, "node-gone"], k=len(members))):
            print(f"a worker of node {node} released")
            plane.release(worker, node)
            for name in [node] if node in plane.caches else plane.caches:
                expected[name].append(key(worker))
        expected = {n: sorted(holders) for n, holders in expected.items()}
        deadline = time.monotonic() + 30  # not waited for: the calls land a moment later, in any order (4 threads)
        while (got := {n: sorted(ray.get(c.holders_released.remote())) for n, c in plane.caches.items()}) != expected:
            assert time.monotonic() < deadline, got
            time.sleep(0.05)
        assert plane.attached == set()
    finally:
        for actor in [*members, cache, gated, other, relay]:
            ray.kill(actor)
