"""Warm pool: worker actors already built (torch imported, model made, data opened)
but outside the process group, so a join costs a state copy and a re-form, not a
process start (~3 s here, 80-110 s for a cold cloud node).

Pending pool actors are resource demand, and `reserve` asks the Ray autoscaler
for room explicitly (`request_resources`), so on a real cluster the pool
survives node churn: a lost node is replaced and the pool refills onto it.
"""

from __future__ import annotations

from collections.abc import Callable

import ray

from etrain.core.config import Config


class WarmPool:
    def __init__(self, cfg: Config, manifest: str, retire: Callable[[list], None]):
        self.cfg, self.manifest = cfg, manifest
        self.retire = retire  # stops workers and frees what they held (their shard-cache pins)
        self.idle: list = []
        self.warming: dict = {}  # worker -> its warm_up call, until the coordinator prepares it
        self.preparing: dict = {}  # worker -> its cache attach (the coordinator's), done = ready to join
        self._reserved: int | None = None
        self.kept_off: set[str] = set()  # nodes new pool workers must not start on (at risk, or cooling down)
        self.kept_off_at_start: dict = {}  # worker -> the nodes it was kept off when it was started

    def refill(self, size: int) -> None:
        """Top up to `size` workers (control.pool_size) without waiting for the new actors to start.
        A pool above it is not trimmed here: workers leave it by joining, or when a change gives some back."""
        missing = size - len(self.idle)
        if missing > 0:
            from etrain.worker import (
                spawn,  # torch, lazily: the driver imports this module and loads torch in a thread while Ray starts
            )

            fresh = spawn(self.cfg, self.manifest, missing, self.kept_off)
            self.kept_off_at_start |= {w: frozenset(self.kept_off) for w in fresh}
            self.warming |= {w: w.warm_up.remote() for w in fresh}  # queued first: "up" then means warmed up
            self.idle += fresh

    def newly_ready(self) -> list:
        """Pool workers that finished warming up since the last call."""
        if not self.warming:
            return []
        done, _ = ray.wait(list(self.warming.values()), num_returns=len(self.warming), timeout=0)
        ready = [w for w, ref in self.warming.items() if ref in done]
        for w in ready:
            del self.warming[w]
        return ready

    def restart_kept_off(self) -> None:
        """Workers still starting that were kept off a node that is allowed again (its cool-down is over) may be
        waiting for room only that node has: they are stopped, and the next refill starts them without it."""
        self.drop([w for w in self.warming if self.kept_off_at_start.get(w, frozenset()) - self.kept_off])

    def take(self, count: int) -> list:
        """Up to `count` ready workers. Never one still starting: it may wait minutes for a node,
        and a membership change must not wait for it; it joins at a later step boundary."""
        chosen = self.ready_workers()[:count]
        self.idle = [w for w in self.idle if w not in chosen]
        for w in chosen:
            del self.preparing[w]
            self.kept_off_at_start.pop(w, None)
        return chosen

    def drop(self, workers: list) -> None:
        """Stop pool workers (on a node being drained, or beyond the pool's size); the next refill replaces them."""
        for w in workers:
            self.idle.remove(w)
            self.warming.pop(w, None)
            self.preparing.pop(w, None)
            self.kept_off_at_start.pop(w, None)
        self.retire(workers)

    def ready(self) -> int:
        """Pool workers warmed up and attached to their node's cache: a join costs them no start-up."""
        return len(self.ready_workers())

    def ready_workers(self) -> list:
        refs = list(self.preparing.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        return [w for w, ref in self.preparing.items() if ref in done]

    def give_back(self, workers: list, keep: int) -> None:
        """Workers leaving the group are warm and attached: they go back in, ahead of pool workers
        still starting. Beyond `keep` (the pool's size plus the joiners the coming change takes
        from it), the pool is trimmed, workers still starting first."""
        self.idle = workers + self.idle
        self.preparing |= {w: w.info.remote() for w in workers}
        self.drop(surplus(self.idle, set(self.warming), keep))

    def reserve(self, members: int) -> None:
        """Ask the autoscaler for room for `members` workers plus the pool. The request persists
        (nodes are kept, lost ones replaced) until the next call; `reserve(0)` at the end drops it."""
        from ray.autoscaler.sdk import request_resources

        if members == self._reserved:
            return
        self._reserved = members
        c = self.cfg.cluster
        bundle = {"CPU": c.cpus_per_worker} | ({"GPU": c.gpus_per_worker} if c.gpus_per_worker else {})
        request_resources(bundles=[bundle] * (members + c.warm_pool if members else 0))

    def close(self) -> None:
        self.drop(list(self.idle))


def surplus(idle: list, warming: set, keep: int) -> list:
    """The pool workers beyond `keep` to stop: those still starting first (the warm ones are worth more)."""
    return sorted(idle, key=lambda w: w in warming)[keep:]
