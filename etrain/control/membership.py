"""Who trains and who waits: the group's members and what each is (node, pid, peak FLOP/s), the warm pool,
the nodes being drained, and the world size wanted. Every change happens here, at a step boundary.

A change keeps the live actors: leavers go back to the pool, joiners come warm from it and get
the state of a live peer (peer to peer, through the object store), and the group is re-formed
under a new store prefix. No restart, no checkpoint load, except where ZeRO-1 lost a shard.

With a layout (parallel.tp × parallel.pp ranks per replica) the unit is the replica: members are kept
in whole replicas, in rank order (rank = replica · ranks + stage · tp + shard), a replica missing a rank
leaves whole (its live ranks back to the pool), and joiners come tp × pp × shard at a time, each rank taking the
state of its twin: the rank at the same place in a live replica.
Each change is a `membership` record with its phases (CHANGE_PHASES), closed by the first step
after it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import ray

from etrain.control.control import JobError, autoscale, pool_size
from etrain.control.data_plane import ATTACH_S
from etrain.control.gather import WorkersLost, gather, ping
from etrain.control.pool import WarmPool
from etrain.control.relay import Relays
from etrain.control.step import Position
from etrain.core.config import Config
from etrain.core.errors import why
from etrain.core.flops import flops_per_token, mfu
from etrain.core.modes import mode_of
from etrain.core.records import JOIN_PHASES, Autoscale, Membership, Warn

logger = logging.getLogger(__name__)

WATCH_S = 1.0  # how often the cluster is looked at: preemption notices, new nodes, room to grow


@dataclass(frozen=True)
class Lost:
    """Members lost between or during steps: a recovery comes next. `since` starts its "detect" phase."""

    members: list
    since: float
    cause: str = ""  # what ended the wait that found them lost (etrain/control/gather.py)


@dataclass(frozen=True)
class ResizePlan:
    keep: list  # members that stay, in rank order
    leaving: list  # members going back to the pool
    drained: list  # members on draining nodes: stopped, no clean exit
    joining: int  # ready pool workers to take
    reason: str


def plan_resize(
    workers: list, nodes: dict, preempted: set, target: int, ranks: int = 1, at_risk: frozenset = frozenset()
) -> ResizePlan:
    """Members on draining nodes leave (a preemption; a drain when the nodes `at_risk` hold them all), and with them
    the rest of their replicas (`ranks` members each); then the group shrinks to, or grows towards, `target` (a
    whole number of replicas), whole replicas leaving from the end."""
    drained = [w for w in workers if nodes.get(w) in preempted | at_risk]
    intact, broken = whole_replicas(workers, drained, ranks)
    keep, leaving = intact[:target], [w for w in broken if w not in drained] + intact[target:]
    if drained:
        reason = "drain" if all(nodes.get(w) in at_risk - preempted for w in drained) else "preemption"
    else:
        reason = "scale-in" if target < len(workers) else "scale-out"
    return ResizePlan(keep, leaving, drained, target - len(keep), reason)


def whole_replicas(workers: list, lost: list, ranks: int) -> tuple[list, list]:
    """The members of replicas that lost none of their `ranks` members, in order; and the members of the others."""
    lost = set(lost)  # hashed: a thousand members, each looked for in a list of a thousand, is a million compares
    replicas = [workers[i : i + ranks] for i in range(0, len(workers), ranks)]
    intact, broken = [], []
    for r in replicas:
        (broken if any(w in lost for w in r) else intact).extend(r)
    return intact, broken


def twin(rank: int, applied: list[int], step: int, ranks: int) -> int | None:
    """A rank at the same place as `rank` in another replica that holds `step`: where `rank` takes its state."""
    return next((j for j in range(rank % ranks, len(applied), ranks) if applied[j] == step), None)


class Team:
    def __init__(self, cfg: Config, manifest: str, workers: list, data, balancer, log, resume_hint: str):
        self.cfg, self.data, self.balancer, self.log, self.resume_hint = cfg, data, balancer, log, resume_hint
        self.workers = workers
        self.ranks = cfg.parallel.ranks  # members per replica, the unit of membership
        self.mode = mode_of(cfg)
        self.wanted = len(workers)  # asked for by `etrain scale` or the autoscaling policy
        self.autoscaling = cfg.cluster.max_workers is not None
        self.pool = WarmPool(cfg, manifest, self.retire)
        self.nodes: dict = {}  # worker -> node id, for members and prepared pool workers
        self.pids: dict = {}  # worker -> process id, for members (status shows where each rank runs)
        self.peaks: dict = {}  # worker -> peak FLOP/s of its device, None on CPU (MFU's denominator)
        self.marks: dict = {}  # worker -> the wall-clock times of its start (a joiner's `joined` phases)
        self.flops_per_token = 0.0
        self.preempted: set[str] = set()  # nodes with a preemption notice (Ray's draining nodes)
        self.at_risk: frozenset[str] = (
            frozenset()
        )  # nodes at risk whose members leave now (etrain/control/health_watch.py)
        self.replacements = 0  # pool workers wanted beyond cluster.warm_pool: replacements for a node at risk
        self.generation = 0
        self.relays = Relays()  # a step's calls through one actor per node, from cluster.relay_from members on
        self.recoveries = 0
        self._pending: tuple[Membership, float] | None = None  # a change waiting for its first step
        self.pool_started = False  # the coordinator starts the pool after the run's first step
        self._next_watch = 0.0
        self._mfu_warned = False

    # -- waiting for workers ---------------------------------------------------

    def gather(
        self, refs: list, among: list, what: str, timeout: float | None = None, queued: list = (), stop=None, spans=None
    ) -> list:
        """control/gather.py's wait, with this run's ping timeout and the stop that releases cache pins; `queued`:
        calls made after these, waited for (up to timeouts.collective_s) before a failure's pings. `timeout`: a
        wait of another length (a join's); none, a step's work: timeouts.step_s, which a failure then names. `stop`:
        what ends the others' work at a failure (a step's); `spans`: `refs` are node relays' (relay.py). A failure's
        pings go through the relays as the calls do."""
        t = self.cfg.timeouts
        name = "timeouts.step_s" if timeout is None else ""
        timeout = t.step_s if timeout is None else timeout
        return gather(
            refs, among, what, timeout, t.ping_s, self.retire, queued, t.collective_s, name, stop, spans, self._pings
        )

    def ask(self, members: list, method: str, what: str, args: list | None = None, timeout: float | None = None):
        """`method` of each member with `args[rank]` (none: no arguments), waited for as `gather` does: their results
        in rank order. A call per node where the step's calls go through node relays (relay.py), so a member change
        at 1,024 members is not 1,024 calls a phase."""
        args = args if args is not None else [()] * len(members)
        nodes = self._relayed_nodes(members)
        if nodes is None:
            refs = [getattr(w, method).remote(*a) for w, a in zip(members, args)]
            return self.gather(refs, members, what, timeout)
        refs, spans = self.relays.call(method, members, nodes, args)
        return self.gather(refs, members, what, timeout, spans=spans)

    def tell(self, members: list, method: str, *args) -> None:
        """`method(*args)` of each member, not waited for (through the relays as `ask`'s calls)."""
        nodes = self._relayed_nodes(members)
        if nodes is not None:
            self.relays.tell(method, members, nodes, args)
            return
        for w in members:
            getattr(w, method).remote(*args)

    def _pings(self, workers: list, timeout: float) -> tuple[list, list]:
        """gather.py's `ping`, through the relays as `ask`'s calls."""
        nodes = self._relayed_nodes(workers)
        return ping(workers, timeout) if nodes is None else self.relays.ping(workers, nodes, timeout)

    def _relayed_nodes(self, members: list) -> list[str] | None:
        """The members' nodes, where calls to them go through relays: from cluster.relay_from members on, each
        member's node known and its relay started (a change does not wait for a relay's start)."""
        if not self.relayed(len(members)):
            return None
        nodes = [self.nodes.get(w) for w in members]
        return nodes if None not in nodes and self.relays.covers(nodes) else None

    def retire(self, workers: list) -> None:
        """Stop workers for good, and release the shard-cache pins they held (a killed reader cannot)."""
        for w in workers:
            ray.kill(w)
            self.data.release(w, self.nodes.get(w))

    # -- the cluster, between steps ---------------------------------------------

    def watch(self, at: Position) -> None:
        """Preemption notices, new nodes (their shard cache and relay start at once, beside the workers starting
        there), the pool's size and, when autoscaling, room to grow: once a second, and the room also at
        every step boundary where a ready pool worker could join."""
        if self.autoscaling and self.pool.ready() and len(self.workers) < self.cfg.cluster.max_workers:
            self._autoscale(at.step)
        if time.monotonic() < self._next_watch:
            return
        self._next_watch = time.monotonic() + WATCH_S
        self.preempted = preempted_nodes()
        kept_off = self.preempted | self.pool.kept_off
        self.pool.drop([w for w in self.pool.idle if self.nodes.get(w) in kept_off])
        nodes = worker_nodes(self.cfg.cluster) - kept_off
        self.data.start_caches(nodes, at.cursor)
        if self.relayed(self.target()):  # its relay too, long before a worker built there joins
            self.relays.prepare(nodes)
        self.pool.restart_kept_off()
        # not before the run's first step, nor while a change waits for its first step: a starting worker slows it
        if self._pending is None and self.pool_started:
            self.refill()
        if self.autoscaling:
            self._autoscale(at.step)

    def _autoscale(self, step: int) -> None:
        c, before, world = self.cfg.cluster, self.wanted, len(self.workers)
        self.wanted = self._whole(
            autoscale(world, self._free_slots(), self.pool.ready(), len(self.pool.idle), c.max_workers, c.warm_pool)
        )
        if self.wanted != before:
            self.log.record(Autoscale(step, world, self.wanted))

    def _free_slots(self) -> int:
        """Workers the cluster has room for now, beyond the pool (its workers still starting count as placed)."""
        c = self.cfg.cluster
        free = ray.available_resources()
        slots = int(free.get("CPU", 0) // c.cpus_per_worker)
        if c.gpus_per_worker:
            slots = min(slots, int(free.get("GPU", 0) // c.gpus_per_worker))
        return max(0, slots - len(self.pool.warming))

    def pool_size(self) -> int:
        max_workers = self.cfg.cluster.max_workers if self.autoscaling else None
        # Room is counted once the pool's starting workers have started: Ray's view of free resources lags
        # their placement, and a second cold start beside one still going slows both.
        free = self._free_slots() if self.autoscaling and not self.pool.warming else 0
        warm_pool = self.cfg.cluster.warm_pool + self.replacements
        return pool_size(len(self.workers), self.wanted, free, len(self.pool.idle), warm_pool, max_workers)

    def refill(self) -> None:
        """The pool back to its size; the autoscaler asked for room."""
        self.pool_started = True
        self.pool.refill(self.pool_size())
        members = self.cfg.cluster.max_workers if self.autoscaling else max(self.wanted, len(self.workers))
        self.pool.reserve(members + self.replacements)

    def ready_elsewhere(self, kept_off: set) -> int:
        """Ready pool workers on nodes outside `kept_off`: the replacements a drain can take."""
        return sum(self.nodes.get(w) not in kept_off for w in self.pool.ready_workers())

    def mark_nodes(self, at_risk: set[str], kept_off: set[str], replacements: int) -> None:
        """The health watch's decisions at this boundary: the nodes whose members leave now, the nodes no new
        worker goes to, and the replacements the pool brings for a node waiting to be drained."""
        self.at_risk, self.pool.kept_off, self.replacements = frozenset(at_risk), set(kept_off), replacements

    @property
    def draining(self) -> set[str]:
        """Nodes whose members leave at the next step boundary: preempted, or at risk."""
        return self.preempted | self.at_risk

    def prepare_pool(self, at: Position) -> None:
        """Attach pool workers that finished warming up to their node's cache while they wait. The attach is
        waited for a moment (the node's cache has the shard already, most often: then the worker can join
        at this step boundary), not longer: a slow download must not hold up training."""
        for worker in self.pool.newly_ready():
            try:
                self.nodes[worker] = node = ray.get(worker.info.remote(), timeout=self.cfg.timeouts.ping_s)["node"]
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                # died starting: the next refill replaces it
                logger.warning("a warm-pool worker did not start: %s", why(e))
                self.pool.drop([worker])
                continue
            if node in self.preempted | self.pool.kept_off:  # a preemption notice, or at risk: no use waiting there
                self.pool.drop([worker])
                continue
            self.pool.preparing[worker] = attach = self.data.attach([worker], [node], at.cursor, read=True)[0]
            ray.wait([attach], timeout=ATTACH_S)

    def await_ready(self, count: int, at: Position) -> None:
        """Wait, up to timeouts.join_s, until the pool has `count` ready workers (refilled, and attached as they
        come): a group that lost every member, or every replica, cannot go on without them."""
        deadline = time.monotonic() + self.cfg.timeouts.join_s
        while self.pool.ready() < count and time.monotonic() < deadline:
            self.pool.refill(max(self.pool_size(), count))
            self.prepare_pool(at)
            time.sleep(0.05)

    def target(self) -> int:
        """The world size the next step boundary can reach: shrinking at once, growing by ready pool workers only."""
        world = len(self.workers)
        return self.wanted if self.wanted <= world else world + self._whole(min(self.wanted - world, self.pool.ready()))

    def _whole(self, workers: int) -> int:
        """Down to a whole number of replicas."""
        return workers - workers % self.ranks

    def draining_members(self) -> int:
        """Members on draining nodes: they leave at the next step boundary."""
        draining = self.draining  # a union, made once: not once a member (1,024 a step at 1,024 members)
        return sum(self.nodes.get(w) in draining for w in self.workers) if draining else 0

    def request(self, workers: int) -> None:
        """`etrain scale`: a manual request pins the size, and the autoscaling policy stops for this run."""
        self.wanted, self.autoscaling = workers, False

    # -- changes ------------------------------------------------------------------

    def resize(self, at: Position, whole=None) -> Lost | None:
        """Members on draining nodes leave (preemption); then shrink to, or grow towards, the target.
        `whole`: a ZeRO-1 state gathered before anyone leaves, which every member then loads."""
        started = time.perf_counter()
        kept_off = self.draining | self.pool.kept_off
        self.pool.drop([w for w in self.pool.idle if self.nodes.get(w) in kept_off])  # no joiner from there
        plan = plan_resize(self.workers, self.nodes, self.preempted, self.target(), self.ranks, self.at_risk)
        self.retire(plan.drained)  # its node is going away: no clean exit needed, and it may be gone already
        self._give_back(plan.leaving, plan.joining)
        return self.change(plan.keep, plan.joining, plan.reason, at, started, lost=len(plan.drained), whole=whole)

    def _give_back(self, leaving: list, joining: int) -> None:
        """Leavers out of the group and into the pool, which keeps its size plus the `joining` the change takes."""
        try:
            self.ask(leaving, "leave", "group exit", timeout=self.cfg.timeouts.join_s)
        except WorkersLost as gone:  # a leaver that died is simply not given back
            leaving = [w for w in leaving if w not in gone.lost]
        self.pool.give_back(leaving, keep=max(self.pool_size(), self.cfg.cluster.warm_pool + joining))

    def recover(self, lost: Lost, at: Position, whole=None) -> Lost | None:
        """Survivors plus ready pool workers redo the step; fewer if the pool is short (more join when ready).
        With a layout the survivors are the replicas that lost no rank; the live ranks of the others go back to the
        pool."""
        survivors, broken = whole_replicas(self.workers, lost.members, self.ranks)
        if mates := [w for w in broken if w not in lost.members]:
            self._give_back(mates, self.wanted - len(survivors))
        if not survivors:  # the group starts over from the pool (with `whole`, a checkpoint): a replica's worth
            self.await_ready(self.ranks, at)
        self.recoveries += 1
        return self.change(
            survivors, self.wanted - len(survivors), "recover", at, lost.since, lost=len(lost.members), whole=whole
        )

    def change(
        self, members: list, joining: int, reason: str, at: Position, started: float, lost: int = 0, whole=None
    ) -> Lost | None:
        """Re-form the group as `members` plus up to `joining` ready pool workers; each phase timed."""
        phases = {"detect": time.perf_counter() - started}
        t = time.perf_counter()
        joiners = self._placed(self.pool.take(self._whole(min(joining, self.pool.ready())))) if joining > 0 else []
        phases["acquire"] = time.perf_counter() - t
        self._close(stepped=False)
        leaving = sorted(self.draining)
        event = Membership(at.step, reason, len(self.workers), len(members) + len(joiners), lost, len(joiners),
                           [self.nodes.get(w) for w in joiners], leaving, phases)  # fmt: skip
        if not members + joiners:
            raise JobError(
                f"no whole replica left and {self.pool.ready()} of the {self.ranks} workers it needs ready in the warm "
                f"pool within timeouts.join_s (cluster.warm_pool={self.cfg.cluster.warm_pool}); {self.resume_hint}"
                if self.mode.placed_state
                else f"no worker left and none ready in the warm pool within timeouts.join_s; {self.resume_hint}"
            )
        self.balancer.forget(members + joiners)
        try:
            self.form(members + joiners, at, reason, phases, whole)
        except WorkersLost as gone:  # the next decision is a recovery, with the members still alive
            self.workers = members + joiners  # the lost in place: the recovery tells whole replicas by position
            logger.warning("%d worker(s) lost during a %s at step %d; recovering", len(gone.lost), reason, at.step)
            return Lost(gone.lost, time.perf_counter())
        if joiners:
            last = max((self.marks[w] for w in joiners), key=lambda m: m.get("attached", 0))
            event.joined = arrival(last, time.time() - (time.perf_counter() - started))
            event.joined_at = last["process"]
        self._pending = (event, started)  # the pool refills after its first step
        return None

    def _placed(self, joiners: list) -> list:
        """Joiners in rank order, by node: the consecutive ranks of a tensor-parallel group share a node where the
        pool has tp workers on one (the gradient traffic of TP is per layer; of PP and DP, per step)."""
        return sorted(joiners, key=lambda w: str(self.nodes.get(w))) if self.cfg.parallel.tp > 1 else joiners

    def form(self, members: list, at: Position, reason: str, phases: dict | None = None, whole=None) -> None:
        """Make `members` the group at step `at.step`: caches, state from a live peer (or `whole`, a state every member
        loads after leaving the old group: ZeRO-1 re-shards it), a new generation. WorkersLost if one dies."""
        join_s, step = self.cfg.timeouts.join_s, at.step
        phases = phases if phases is not None else {}
        t = time.perf_counter()
        infos = self.ask(members, "info", "worker start", timeout=join_s)
        self._note(members, infos)
        fresh = [(w, i["node"]) for w, i in zip(members, infos) if w not in self.data.attached]
        self.gather(
            self.data.attach([w for w, _ in fresh], [n for _, n in fresh], at.cursor), members, "cache attach", join_s
        )
        behind = [w for w, i in zip(members, infos) if i["applied"] != step]
        if behind and reason != "start" and whole is None and not self.mode.placed_state:
            source = next((w for w, i in zip(members, infos) if i["applied"] == step), None)
            if source is None:
                raise JobError(f"no live worker holds step {step}; {self.resume_hint}")
            state = source.state.remote()  # passed by reference: the object store carries it peer to peer
            self.gather([w.load_state.remote(state, step) for w in behind], members, "state migration", join_s)
        phases["migrate"] = time.perf_counter() - t
        t = time.perf_counter()
        self.ask(members, "leave", "group exit", timeout=join_s)
        if whole is not None and not self.mode.placed_state:  # a laid-out rank takes its part once in the group
            loaded = time.perf_counter()
            self.gather([w.load_state.remote(whole, step) for w in members], members, "state migration", join_s)
            phases["migrate"] += time.perf_counter() - loaded
            t += time.perf_counter() - loaded
        self.generation += 1
        host, port = self.gather([members[0].host_store.remote()], members, "store start", join_s)[0]
        joins = [(rank, len(members), host, port, self.generation) for rank in range(len(members))]
        applied = self.ask(members, "join", "process group formation", joins, join_s)
        phases["reform"] = time.perf_counter() - t
        if self.mode.placed_state and (whole is not None or reason != "start"):
            t = time.perf_counter()
            if whole is not None:  # each rank its part of the checkpoint's whole model
                self.gather([w.load_state.remote(whole, step) for w in members], members, "state load", join_s)
            else:
                self._from_twins(members, applied, step)
            phases["migrate"] += time.perf_counter() - t
        self.workers = members

    def _from_twins(self, members: list, applied: list[int], step: int) -> None:
        """Each laid-out rank without its place's state at `step` takes its twin's, peer to peer."""
        loads = []
        for rank in (r for r, a in enumerate(applied) if a != step):
            source = twin(rank, applied, step, self.ranks)
            if source is None:
                raise JobError(f"no live replica holds step {step} for rank {rank}'s place; {self.resume_hint}")
            loads.append(members[rank].load_state.remote(members[source].state.remote(), step))
        self.gather(loads, members, "state migration", self.cfg.timeouts.join_s)

    def consolidate(self):
        """ZeRO-1: the whole state, gathered from the group's optimizer shards (a ref, rank 0's). WorkersLost
        if a member is gone (a preempted node may be): then recovery goes back to the last checkpoint."""
        refs = [w.state.remote() for w in self.workers]
        self.gather(refs, self.workers, "gathering the ZeRO-1 optimizer state")
        return refs[0]

    def stepped(self) -> None:
        """A step committed: the pending change, if any, is closed with its first step."""
        self._close(stepped=True)

    def _close(self, stepped: bool) -> None:
        """Record the pending change; its first_step phase only if a step followed it (a change can follow
        another at once: a preemption's shrink, then a ready worker's join)."""
        if self._pending is None:
            return
        (event, started), self._pending = self._pending, None
        if stepped:
            event.phases["first_step"] = time.perf_counter() - started - sum(event.phases.values())
        event.total_s = sum(event.phases.values())
        self.log.record(event)

    def _note(self, members: list, infos: list[dict]) -> None:
        self.nodes |= {w: i["node"] for w, i in zip(members, infos)}
        self.pids |= {w: i["pid"] for w, i in zip(members, infos)}
        self.peaks |= {w: i["peak_flops"] for w, i in zip(members, infos)}
        self.marks |= {w: i["marks"] for w, i in zip(members, infos)}
        self.flops_per_token = flops_per_token(self.cfg.model, infos[0]["params"], infos[0]["trainable"])

    def start_ps(self, at: Position) -> None:
        """Parameter-server mode: the workers as they are (no group), on their nodes' caches."""
        infos = self.ask(self.workers, "info", "worker start", timeout=self.cfg.timeouts.join_s)
        self._note(self.workers, infos)
        self.gather(self.data.attach(self.workers, [i["node"] for i in infos], at.cursor), self.workers, "cache attach")

    # -- what the members are -------------------------------------------------------

    def mfu(self, tokens_per_s: float, step: int) -> float | None:
        value = mfu(self.flops_per_token, tokens_per_s, [self.peaks[w] for w in self.workers])
        if value is None and None not in self.peaks.values() and not self._mfu_warned:
            self._mfu_warned = True
            self.log.record(
                Warn(
                    step,
                    "MFU above 100%: the device peak (core/flops.py) is wrong for this device; MFU is left out of "
                    "the records",
                )
            )
        return value

    def members(self) -> list[dict]:
        """Each rank's node, pid and measured speed (once it has started)."""
        par = self.cfg.parallel
        return [
            {"rank": r, "node": self.nodes[w], "pid": self.pids[w], "speed": self.balancer.speeds.get(w)}
            | (asdict(par.place(r)) if self.mode.placed_state else {})
            for r, w in enumerate(self.workers)
            if w in self.pids
        ]

    def relayed(self, members: int) -> bool:
        """Whether a step goes to `members` members through node relays (relay.py): from cluster.relay_from on."""
        return 0 < self.cfg.cluster.relay_from <= members

    def stop(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        self.pool.close()
        self.pool.reserve(0)
        self.relays.close()


def arrival(marks: dict, changed: float) -> dict[str, float]:
    """A joiner's start (its wall-clock `marks`, etrain/worker/actor.py) up to the change that took it (`changed`), as
    JOIN_PHASES. A mark it never passed (a warm-up it never had) is a phase of 0."""
    points = [marks["process"]]
    for mark in ("loading", "init", "built", "warmed", "attached"):
        points.append(marks.get(mark, points[-1]))
    points.append(max(changed, points[-1]))
    return {phase: round(b - a, 4) for phase, (a, b) in zip(JOIN_PHASES, zip(points, points[1:]))}


def worker_nodes(c) -> set[str]:
    """Alive nodes big enough for one worker of `c` (cluster config): where pool workers can start."""
    fits = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= c.cpus_per_worker]
    return {n["NodeID"] for n in fits if not c.gpus_per_worker or n["Resources"].get("GPU", 0) >= c.gpus_per_worker}


def preempted_nodes() -> set[str]:
    """Nodes with a drain request: a preemption notice (autoscaler v2, KubeRay, `ray drain-node`)
    or an idle termination. Ray exposes it only internally (Ray Serve reads it the same way)."""
    return set(ray._private.state.state.get_draining_nodes())
