"""A step's calls to its members through one relay actor per node: the coordinator makes a call per node, not per
member.

At 1,024 members the coordinator spent most of a step submitting 1,024 calls and reading 1,024 answers
(bench/scale.py); the relay, on the members' node, makes its members' calls there and answers with all of their
results at once, or at the first of them that fails (with what was back by then), so `gather` (gather.py) ends a
failed step as early as it does without relays. It holds no state but its members' handles, sent with the first
step of each group (`generation`), and imports no torch. Used from `cluster.relay_from` members on.

The relay also asks its node's shard cache for its counts (what it fetched), and they ride back in its first member's
report (`data["cache"]`): the coordinator otherwise asks every node's cache itself each step (DataPlane.cost), 128
calls and their answers a step at 1,024 members. The question goes out with a step and its answer rides with the
first step that ends after it is back: never waited for (the counts are totals: late is counted later).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


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
        self.cache: tuple[str, object] | None = None  # its node's id and shard cache, once sent
        self.counting: asyncio.Future | None = None  # that cache's counts, asked for and not yet given back

    def ready(self) -> bool:
        """For a caller that waits for the relay's start."""
        return True

    async def step(
        self, n: int, generation: int, handles: list | None, works: list[dict], faults: list, cache=None
    ) -> Relayed:
        """Step `n`'s calls to the members (`handles`: those of a new group; `cache`: the node's id and cache, when
        the coordinator has one it has not sent)."""
        if handles is not None:
            self.generation, self.members = generation, handles
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
        self.held: dict[str, int] = {}  # node -> the group whose handles its relay holds
        self.caches: dict[str, object] = {}  # node -> the shard cache its relay holds

    def step(
        self, n: int, generation: int, workers: list, nodes: list[str], works: list[dict], faults: dict, caches: dict
    ):
        """Step `n`'s calls, a call per node: the relays' refs, and each ref's member ranks (gather's `spans`).
        `works[rank]` and `faults.get(rank)` are rank `rank`'s arguments, as a direct call's; `caches` the nodes'
        shard caches (node -> cache), each sent to its relay once."""
        spans: dict[str, list[int]] = {}
        for rank, node in enumerate(nodes):
            spans.setdefault(node, []).append(rank)
        refs = []
        for node, ranks in spans.items():
            relay = self.actors.get(node) or self._start(node)
            handles = [workers[r] for r in ranks] if self.held.get(node) != generation else None
            args = [works[r] for r in ranks], [faults.get(r) for r in ranks]
            cache = caches.get(node)
            sent = (node, cache) if cache is not None and self.caches.get(node) is not cache else None
            refs.append(relay.step.remote(n, generation, handles, *args, sent))
            self.held[node] = generation
            if sent is not None:
                self.caches[node] = cache
        return refs, list(spans.values())

    def prepare(self, nodes: set[str]) -> None:
        """A relay on each of `nodes` that has none, not waited for."""
        for node in nodes - self.actors.keys():
            self._start(node)

    def _start(self, node: str):
        here = NodeAffinitySchedulingStrategy(node, soft=False)
        self.actors[node] = actor = REMOTE.options(num_cpus=0, scheduling_strategy=here).remote()
        self.held.pop(node, None)  # a new relay holds nothing yet
        self.caches.pop(node, None)
        return actor

    def close(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors, self.held, self.caches = {}, {}, {}
