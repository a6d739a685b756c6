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

    def refill(self) -> None:
        """Top up to `cluster.warm_pool` without waiting for the new actors to start."""
        missing = self.cfg.cluster.warm_pool - len(self.idle)
        if missing > 0:
            from actors.worker import spawn  # brings torch: only a coordinator with a pool pays for it

            fresh = spawn(self.cfg, self.manifest, missing)
            for w in fresh:
                w.warm_up.remote()  # queued before any other call: "up" then means warmed up
            self.idle += fresh

    def take(self, count: int) -> tuple[list, int]:
        """`count` workers: pool ones first (waiting for one still starting beats starting another), then cold ones.

        Also returns how many were already up (answered within 0.2 s): the truly warm joins.
        """
        from actors.worker import spawn

        chosen, self.idle = self.idle[:count], self.idle[count:]
        chosen += spawn(self.cfg, self.manifest, count - len(chosen))
        up, _ = ray.wait([w.info.remote() for w in chosen], num_returns=len(chosen), timeout=0.2)
        return chosen, len(up)

    def ready(self) -> int:
        """Pool workers already started."""
        if not self.idle:
            return 0
        up, _ = ray.wait([w.info.remote() for w in self.idle], num_returns=len(self.idle), timeout=0.2)
        return len(up)

    def give_back(self, workers: list) -> None:
        room = max(0, self.cfg.cluster.warm_pool - len(self.idle))
        self.idle += workers[:room]
        for w in workers[room:]:
            ray.kill(w)

    def close(self) -> None:
        for w in self.idle:
            ray.kill(w)
        self.idle = []
