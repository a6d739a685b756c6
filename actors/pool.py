"""Warm pool: worker actors already built (torch imported, model made, data opened)
but outside the process group, so a join costs a state copy and a re-form, not a
process start (~3 s here, 80-110 s for a cold cloud node).

Pending pool actors are resource requests: on a real cluster they are what makes
the Ray autoscaler add nodes, so the pool survives node churn.
"""

from __future__ import annotations

import ray

from app.config import Config


class WarmPool:
    def __init__(self, cfg: Config, manifest: str):
        self.cfg, self.manifest = cfg, manifest
        self.idle: list = []
        self.warming: dict = {}  # worker -> its warm_up call, until the coordinator prepares it
        self.preparing: dict = {}  # worker -> its cache attach (the coordinator's), done = ready to join

    def refill(self) -> None:
        """Top up to `cluster.warm_pool` without waiting for the new actors to start."""
        missing = self.cfg.cluster.warm_pool - len(self.idle)
        if missing > 0:
            from actors.worker import spawn  # brings torch: only a coordinator with a pool pays for it

            fresh = spawn(self.cfg, self.manifest, missing)
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

    def take(self, count: int) -> tuple[list, int]:
        """`count` workers: pool ones first, prepared ones first among them (waiting for one still
        starting beats starting another), then cold ones. Also returns how many were prepared."""
        from actors.worker import spawn

        prepared = self._prepared()
        self.idle.sort(key=lambda w: w not in prepared)
        chosen, self.idle = self.idle[:count], self.idle[count:]
        for w in chosen:
            self.preparing.pop(w, None)
            self.warming.pop(w, None)
        return chosen + spawn(self.cfg, self.manifest, count - len(chosen)), sum(w in prepared for w in chosen)

    def ready(self) -> int:
        """Pool workers warmed up and attached to their node's cache: a join costs them no start-up."""
        return len(self._prepared())

    def _prepared(self) -> list:
        refs = list(self.preparing.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        return [w for w, ref in self.preparing.items() if ref in done]

    def give_back(self, workers: list) -> None:
        """Workers leaving the group: already warm and attached, they go straight back in."""
        room = max(0, self.cfg.cluster.warm_pool - len(self.idle))
        self.idle += workers[:room]
        self.preparing |= {w: w.info.remote() for w in workers[:room]}
        for w in workers[room:]:
            ray.kill(w)

    def close(self) -> None:
        for w in self.idle:
            ray.kill(w)
        self.idle = []
