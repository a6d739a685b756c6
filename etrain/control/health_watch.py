"""Predictive maintenance: each node's failure risk (core/health.py) from its telemetry (control/telemetry.py,
and the scripted readings of ecc drills) and its ranks' speed, and the drain of a node at risk before it fails.

A drain is a planned resize at a step boundary, the way a preemption notice is one (etrain/control/membership.py): the
node's members leave, ready warm-pool workers on healthy nodes take their places with a live peer's state, and
no step is redone. Until replacements are ready the node is kept out of new placements and the pool grows to
bring them (a pending worker is the autoscaler's demand); a rule (an Xid, an uncorrectable error) drains at once
down to cluster.min_workers. A drained node gets no workers for health.cooldown_s; one drained
health.lemon_drains times is a lemon. Each level change and action is a `health` record.
"""

from __future__ import annotations

import logging
import time

import ray

from etrain.control import telemetry
from etrain.control.faults import ScriptedTelemetry
from etrain.core.config import Config
from etrain.core.health import Drift, NodeHealth, Risk, combine
from etrain.core.modes import mode_of
from etrain.core.records import Health

logger = logging.getLogger(__name__)


class HealthWatch:
    def __init__(self, cfg: Config, team, faults, log):
        self.cfg, self.c, self.team, self.faults, self.log = cfg, cfg.health, team, faults, log
        self.nodes: dict[str, NodeHealth] = {}
        self.drift = Drift(self.c)
        self.own_speeds = mode_of(cfg).splits_by_speed  # each member's speed is its own (not a replica's ranks')
        self.script = ScriptedTelemetry(self.c.script) if self.c.script else None
        self.risk: dict[str, Risk] = {}
        self.level: dict[str, str] = {}  # node -> its last recorded action
        self.actors: dict[str, object] = {}  # node -> its telemetry actor
        self.pending: dict[str, object] = {}  # node -> a reading asked for and not yet back
        self.heard: dict[str, float] = {}  # node -> when its telemetry last answered
        self.kept_off: dict[str, float] = {}  # node -> until when it gets no new workers
        self.draining: set[str] = set()  # nodes whose members leave at the next step boundary
        self.replacements = 0  # pool workers wanted beyond cluster.warm_pool: replacements for a node to drain
        self.drains: dict[str, int] = {}
        self.lemons: list[str] = []
        self._next_read = 0.0
        self._by_node: tuple[list, dict] | None = None  # the members' list it was made from, the members by node

    # -- what comes in ------------------------------------------------------------------

    def stepped(self, step: int, speeds: list[float] | None) -> None:
        """After each committed step: the ranks' speeds, and the readings of ecc drills."""
        workers = self.team.workers
        if speeds and len(speeds) == len(workers) and self.own_speeds:
            self.drift.observe(workers, speeds)
        node_of = RankNodes(workers, self.team.nodes)
        scripted = self.script.readings(step, node_of) if self.script else []
        for reading in self.faults.readings(step, node_of) + scripted:
            if reading.node is not None:
                self._node(reading.node).add(reading)

    def _read(self) -> None:
        """Telemetry: the answers that came back, then new questions (never waited for: a step must not stall)."""
        if not self.c.sources:
            return
        for node, ref in list(self.pending.items()):
            done, _ = ray.wait([ref], timeout=0)
            if not done:
                continue
            del self.pending[node]
            try:
                for reading in ray.get(ref):
                    self._node(node).add(reading)
                self.heard[node] = time.time()
            except ray.exceptions.RayError as e:  # Ray restarts it; a node that is gone leaves with its members
                logger.info("telemetry of node %s did not answer: %s", node, e)
        if time.monotonic() < self._next_read:
            return
        self._next_read = time.monotonic() + self.c.every_s
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        for node in set(self.team.nodes.values()) & alive:
            if node not in self.actors:
                self.actors[node] = telemetry.start(node, self.c.sources)
            if node not in self.pending:
                self.pending[node] = self.actors[node].read.remote()

    def _node(self, node: str) -> NodeHealth:
        return self.nodes.setdefault(node, NodeHealth(self.c))

    # -- what goes out ------------------------------------------------------------------------

    def watch(self, step: int) -> set[str]:
        """At each step boundary: read, assess every node, act. The nodes whose members leave now (`draining`);
        `kept_off` and `replacements` say where no new worker goes and how many the pool should add."""
        self._read()
        members = self._members_by_node()
        for node in set(self.nodes) | set(members):
            self.risk[node] = risk = self._assess(node, members.get(node, []))
            self.log.dashboard.node_risk(node, risk.score)
            if node in self.draining or self._cooldown_left(node, time.time()) is not None:
                continue  # leaving, or left and cooling down: nothing more to decide
            if risk.score >= self.c.drain_at and members.get(node):
                self._drain(step, node, risk, len(members[node]))
                continue
            if self.kept_off.get(node) == float("inf"):  # it waited for replacements, and its risk fell: a false alarm
                del self.kept_off[node]
                self.replacements = 0
            if risk.score >= self.c.drain_at / 2:
                self._mark(step, node, risk, "watch")
            elif self.level.get(node) in ("watch", "wait"):
                self._mark(step, node, risk, "clear")
        self._cool_down(step, members)
        return set(self.draining)

    def _assess(self, node: str, members: list) -> Risk:
        health = self._node(node)
        hard = list(dict.fromkeys(health.events))  # a rule's reasons stay until the node is drained and released
        soft = list(health.soft.values()) + [d for w in members if (d := self.drift.assess(w)) is not None]
        return combine(hard, soft, health.synthetic)

    def _drain(self, step: int, node: str, risk: Risk, leaving: int) -> None:
        """Drain `node` once `leaving` replacements are ready elsewhere; a rule's drain goes ahead without them.
        Never below cluster.min_workers: the joiners take a staying member's state."""
        if self.c.action == "observe":
            self._mark(step, node, risk, "watch")
            return
        self.kept_off[node] = float("inf")  # no new worker there, from now on
        ready = self.team.ready_elsewhere(set(self.kept_off))
        remaining = len(self.team.workers) - leaving  # a live member must stay: the joiners take its state
        if not (remaining >= self.cfg.cluster.min_workers and (ready >= leaving or risk.hard)):
            self.replacements = max(self.replacements, leaving - ready)
            self._mark(step, node, risk, "wait")
            return
        self.draining.add(node)
        self.drains[node] = self.drains.get(node, 0) + 1
        self._mark(step, node, risk, "drain")
        if self.drains[node] >= self.c.lemon_drains and node not in self.lemons:
            self.lemons.append(node)
            self._mark(step, node, risk, "lemon")

    def _cool_down(self, step: int, members: dict) -> None:
        """A drained node without members starts its cool-down; one whose cool-down is over may take workers again,
        with its history cleared (a lemon stays listed)."""
        now = time.time()
        for node in [n for n in self.draining if not members.get(n)]:
            self.draining.discard(node)
            self.kept_off[node] = now + self.c.cooldown_s
            self.replacements = 0
        for node, until in list(self.kept_off.items()):
            if until <= now:
                del self.kept_off[node]
                self.nodes.pop(node, None)
                self._mark(step, node, self.risk.get(node, combine([], [], False)), "release")

    def _members_by_node(self) -> dict[str, list]:
        """The members on each node; made again (and the drift of those who left forgotten) only when the group
        changed: the team makes a new list of members at each change, and a member's node is fixed."""
        workers = self.team.workers
        if self._by_node is not None and self._by_node[0] is workers:
            return self._by_node[1]
        self.drift.forget(set(workers))  # a set: `in` the members' list, for each of them, is O(N²)
        by: dict[str, list] = {}
        for w in workers:
            by.setdefault(self.team.nodes.get(w), []).append(w)
        if None not in by:  # kept once every member's node is known
            self._by_node = (workers, by)
        by.pop(None, None)
        return by

    def _mark(self, step: int, node: str, risk: Risk, action: str) -> None:
        if self.level.get(node) == action and action not in ("drain", "lemon"):
            return
        self.level[node] = action
        self.log.record(Health(step, node, risk.score, risk.reasons, action, risk.synthetic))
        if action in ("drain", "wait", "lemon"):
            logger.warning("node %s: risk %.2f (%s): %s", node[:12], risk.score, "; ".join(risk.reasons), action)

    def status(self) -> dict:
        """Per node: its risk, reasons and state (what `etrain status` shows); the lemons."""
        now = time.time()
        nodes = {
            node: {
                "risk": risk.score,
                "reasons": risk.reasons,
                "state": self.level.get(node, "ok"),
                "synthetic": risk.synthetic,
                "cooldown_s": self._cooldown_left(node, now),
                "telemetry_age_s": now - self.heard[node] if node in self.heard else None,
            }
            for node, risk in self.risk.items()
        }
        return {"nodes": nodes, "lemons": list(self.lemons)}

    def _cooldown_left(self, node: str, now: float) -> float | None:
        until = self.kept_off.get(node, float("inf"))  # inf: waiting to be drained, not cooling down
        return max(0.0, until - now) if until < float("inf") else None

    def close(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)


class RankNodes:
    """rank -> the node its member is on now, looked up for the ranks asked (a drill's few): a dict of every rank
    was 1,024 lookups a step at 1,024 workers, for none asked."""

    def __init__(self, workers: list, nodes: dict):
        self.workers, self.nodes = workers, nodes

    def get(self, rank: int, default=None):
        return self.nodes.get(self.workers[rank], default) if 0 <= rank < len(self.workers) else default
