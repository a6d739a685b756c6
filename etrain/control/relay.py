"""A step's calls to its members through one relay actor per node: the coordinator makes a call per node, not per
member.

At 1,024 members the coordinator spent most of a step submitting 1,024 calls and reading 1,024 answers
(bench/scale.py); the relay, on the members' node, makes its members' calls there and answers with all of their
results at once, or at the first of them that fails (with what was back by then), so `gather` (gather.py) ends a
failed step as early as it does without relays. It holds no state but its members' handles (and which of them
are the group of which `generation`, sent with the group's first step), and imports no torch. Used from
`cluster.relay_from` members on.

The relay also asks its node's shard cache for its counts (what it fetched), and they ride back in its first member's
report (`data["cache"]`): the coordinator otherwise asks every node's cache itself each step (DataPlane.cost), 128
calls and their answers a step at 1,024 members. The question goes out with a step and its answer rides with the
first step that ends after it is back: never waited for (the counts are totals: late is counted later).

A member change calls every member too (its pings after a failure, the group's exit and forming, the stop of a
failed step's work): those go through the relays as well (`call`, `ping`, `tell`), otherwise 5 calls per member
of a recovery (3 of a scale-out), each phase 1,024 calls at 1,024 members. A relay is sent each member's handle
once (`new`) and named by its actor id after that: a handle sent with every call cost ~0.17 ms each to pass
(1,024 of them in 128 calls here, 275-322 ms against 108-138 with ids).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from etrain.control.gather import ping, values_of


@dataclass
class Relayed:
    """A relay's answer: its members' results in the order sent, `back[i]` whether member i's result came back
    (a member whose peer failed first may not have), and the first failure, `failed` naming the member."""

    results: list
    back: list[bool]
    failed: int | None = None
    error: BaseException | None = field(default=None, repr=False)


class NodeRelay:
    """The Ray actor: the calls of a step to the members on its node (asynchronous: a call waits on its members
    without blocking the next one, which after a failure may already belong to the recovered group)."""

    def __init__(self):
        self.generation, self.members = -1, []
        self.handles: dict[str, object] = {}  # member id (`key`) -> its handle, each sent once
        self.cache: tuple[str, object] | None = None  # its node's id and shard cache, once sent
        self.counting: asyncio.Future | None = None  # that cache's counts, asked for and not yet given back

    def ready(self) -> bool:
        """For a caller that waits for the relay's start."""
        return True

    async def step(
        self, n: int, generation: int, members: list[str] | None, new: list, works: list, faults: list, cache=None
    ) -> Relayed:
        """Step `n`'s calls to the members (`members`: the ids of a new group's, in rank order; `new`: handles not
        sent before; `cache`: the node's id and cache, when the coordinator has one it has not sent)."""
        if members is not None:
            self.generation, self.members = generation, await self._handles(members, new)
        if generation != self.generation:
            raise RuntimeError(f"this relay holds the members of group {self.generation}, not of group {generation}")
        if cache is not None:
            self.cache, self.counting = cache, None
        refs = [m.step.remote(n, work, fault) for m, work, fault in zip(self.members, works, faults)]
        if self.cache is not None and self.counting is None:
            self.counting = asyncio.ensure_future(_result(self.cache[1].stats.remote()))
        out = await answers(refs)
        if self.counting is not None and self.counting.done() and out.failed is None:
            out.results[0].data["cache"] = cache_counts(self.cache[0], self.counting)
            self.counting = None
        return out

    async def call(self, method: str, members: list[str], new: list, args: list) -> Relayed:
        """`method` of each of `members` (ids) with its `args`: their results, or what was back at the first
        failure (as a step's)."""
        handles = await self._handles(members, new)
        return await answers([getattr(h, method).remote(*a) for h, a in zip(handles, args)])

    async def ping(self, members: list[str], new: list, timeout: float) -> list[str]:
        """Each member's `info`, waited for up to `timeout`: ALIVE, DEAD (its actor is gone) or SILENT, in the
        order of `members` (any other error is the member's, raised as a direct ping's)."""
        pings = [asyncio.ensure_future(_result(h.info.remote())) for h in await self._handles(members, new)]
        await asyncio.wait(pings, timeout=timeout)
        said = []
        for asked in pings:
            if not asked.done():
                asked.cancel()
                said.append(SILENT)
            elif isinstance(asked.exception(), ray.exceptions.RayActorError):
                said.append(DEAD)
            elif asked.exception() is not None:
                raise asked.exception()
            else:
                said.append(ALIVE)
        return said

    async def tell(self, method: str, members: list[str], new: list, args: list) -> None:
        """`method` of each of `members` with its `args`, not waited for (a failed step's stop)."""
        for h, a in zip(await self._handles(members, new), args):
            getattr(h, method).remote(*a)

    async def _handles(self, members: list[str], new: list) -> list:
        """The handles of `members` (ids), `new` kept for later calls. One not here yet was sent with a call that
        Ray has not started (an asynchronous actor's calls may start out of the order sent): waited for."""
        for handle in new:
            self.handles[key(handle)] = handle
        deadline = time.monotonic() + HANDLE_S
        while missing := [m for m in members if m not in self.handles]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"this relay was never sent the handles of members {missing}")
            await asyncio.sleep(0.01)
        return [self.handles[m] for m in members]


ALIVE, DEAD, SILENT = "alive", "dead", "silent"  # a relayed ping's answers
ANSWER_S = 1.0  # how long past its pings' timeout a relay's answer is waited for
HANDLE_S = 30.0  # how long a relay waits for a member's handle sent with a call it has not started


def key(handle) -> str:
    """How a relay names a member after its handle was sent once: the actor's id (a handle hashes by it too)."""
    return handle._actor_id.hex()


# One actor class for every relay: Ray exports a class made by `ray.remote` once, and a class made anew for each
# node was exported for each: 32-53 ms a start submitted here, against 1.6-6 with one class (16 starts, twice)
REMOTE = ray.remote(NodeRelay)


async def answers(refs: list) -> Relayed:
    """The results of `refs`, or what was back at the first failure: the failure of the first member asked, of
    those that failed in the same wait."""
    futures = [asyncio.ensure_future(_result(ref)) for ref in refs]
    index = {f: i for i, f in enumerate(futures)}
    out = Relayed([None] * len(refs), [False] * len(refs))
    pending = set(futures)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for f in sorted(done, key=index.get):
            if (error := f.exception()) is None:  # read for each: an error no one reads is logged as lost
                out.results[index[f]], out.back[index[f]] = f.result(), True
            elif out.failed is None:
                out.failed, out.error = index[f], error
        if out.failed is not None:
            for rest in pending:  # no longer waited for (the calls themselves go on)
                rest.cancel()
            return out
    return out


async def _result(ref):
    return await ref


def cache_counts(node: str, counting: asyncio.Future) -> dict:
    """A node cache's counts for the coordinator (DataPlane.cost): its fetched shards and bytes, or that it is gone
    (`gone`: the coordinator starts another)."""
    if isinstance(counting.exception(), ray.exceptions.RayActorError):
        return {"node": node, "gone": True}
    stats = counting.result()  # any other error is the relay's own, raised
    return {"node": node, "fetched_bytes": stats["fetched_bytes"], "fetched_shards": stats["fetched_shards"]}


class Relays:
    """The team's relays (membership.py), one per node that can host a worker: started as the node is seen, with
    its shard cache (Team.watch), not at a joiner's first step (an actor's start took 6-8 s of a scale-out by a
    node at 32 workers here when the step waited for it); at a node's first step if that comes sooner."""

    def __init__(self):
        self.actors: dict[str, object] = {}  # node -> its relay
        self.held: dict[str, int] = {}  # node -> the group whose members its relay holds
        self.caches: dict[str, object] = {}  # node -> the shard cache its relay holds
        self.sent: dict[str, set] = {}  # node -> the members whose handles its relay holds

    def step(
        self, n: int, generation: int, workers: list, nodes: list[str], works: list[dict], faults: dict, caches: dict
    ):
        """Step `n`'s calls, a call per node: the relays' refs, and each ref's member ranks (gather's `spans`).
        `works[rank]` and `faults.get(rank)` are rank `rank`'s arguments, as a direct call's; `caches` the nodes'
        shard caches (node -> cache), each sent to its relay once."""
        refs, spans = [], by_node(nodes)
        for node, ranks in spans.items():
            relay = self.actors.get(node) or self._start(node)
            members, new = None, []  # a relay holds its members from the group's first step on
            if self.held.get(node) != generation:
                members, new = self._named(node, [workers[r] for r in ranks])
            args = [works[r] for r in ranks], [faults.get(r) for r in ranks]
            cache = caches.get(node)
            sent = (node, cache) if cache is not None and self.caches.get(node) is not cache else None
            refs.append(relay.step.remote(n, generation, members, new, *args, sent))
            self.held[node] = generation
            if sent is not None:
                self.caches[node] = cache
        return refs, list(spans.values())

    def call(self, method: str, workers: list, nodes: list[str], args: list[tuple]):
        """`method` of each of `workers` (on `nodes`) with `args[rank]`, a call per node: the relays' refs and
        their spans, as `step`'s."""
        refs, spans = [], []
        for relay, ranks, members, new in self._per_node(workers, nodes):
            refs.append(relay.call.remote(method, members, new, [args[r] for r in ranks]))
            spans.append(ranks)
        return refs, spans

    def ping(self, workers: list, nodes: list[str], timeout: float) -> tuple[list, list]:
        """gather.py's `ping` through the relays: the dead among `workers` (on `nodes`) and the silent. The members
        of a relay that is gone, or does not answer within `timeout` and ANSWER_S, are pinged directly."""
        refs, spans = [], []
        for relay, ranks, members, new in self._per_node(workers, nodes):
            refs.append(relay.ping.remote(members, new, timeout))
            spans.append(ranks)
        back, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout + ANSWER_S)
        said, _ = values_of(back)
        dead, silent, unasked = [], [], []
        for ref, ranks in zip(refs, spans):
            if ref not in said:
                unasked += [workers[r] for r in ranks]
                continue
            for rank, word in zip(ranks, said[ref]):
                if word != ALIVE:
                    (dead if word == DEAD else silent).append(workers[rank])
        if unasked:
            more_dead, more_silent = ping(unasked, timeout)
            dead, silent = dead + more_dead, silent + more_silent
        return dead, silent

    def tell(self, method: str, workers: list, nodes: list[str], args: tuple) -> None:
        """`method(*args)` of each of `workers`, through their relays, not waited for."""
        for relay, ranks, members, new in self._per_node(workers, nodes):
            relay.tell.remote(method, members, new, [args] * len(ranks))

    def covers(self, nodes) -> bool:
        """Whether each of `nodes` has a relay started (a member change does not wait for one to start)."""
        return self.actors.keys() >= set(nodes)

    def _per_node(self, workers: list, nodes: list[str]):
        """For each node of `workers` (on `nodes`): its relay, the ranks there, their ids and the handles it lacks."""
        for node, ranks in by_node(nodes).items():
            yield self.actors[node], ranks, *self._named(node, [workers[r] for r in ranks])

    def _named(self, node: str, workers: list) -> tuple[list[str], list]:
        """`workers`' ids for `node`'s relay, and the handles of those it was not sent yet."""
        sent = self.sent.setdefault(node, set())
        new = [w for w in workers if w not in sent]
        sent.update(new)
        return [key(w) for w in workers], new

    def prepare(self, nodes: set[str]) -> None:
        """A relay on each of `nodes` that has none, not waited for."""
        for node in nodes - self.actors.keys():
            self._start(node)

    def _start(self, node: str):
        here = NodeAffinitySchedulingStrategy(node, soft=False)
        self.actors[node] = actor = REMOTE.options(num_cpus=0, scheduling_strategy=here).remote()
        self.held.pop(node, None)  # a new relay holds nothing yet
        self.caches.pop(node, None)
        self.sent.pop(node, None)
        return actor

    def close(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors, self.held, self.caches, self.sent = {}, {}, {}, {}


def by_node(nodes: list[str]) -> dict[str, list[int]]:
    """The ranks on each node, in rank order."""
    spans: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        spans.setdefault(node, []).append(rank)
    return spans
