"""One training step as a transaction, read top to bottom in `Stepper.run`.

The next global batch (an exact slice of the sample order at the cursor) is split over
the members by their measured speed; each trains its share, and the gradients meet in
the all-reduce. The step commits (the cursor moves, its record is written) only when
every member finished it. Otherwise the loop learns what happened: members lost (the
recovered group redoes the step; if the survivors had all finished, their all-reduce held
every share, and the step is committed instead), or a non-finite gradient (nobody stepped:
the run goes back to its last checkpoint).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import ray

from etrain.control.control import due
from etrain.control.gather import WorkersLost
from etrain.core.config import Config
from etrain.core.modes import Mode
from etrain.core.records import Balance, Outlier, Train
from etrain.data import order
from etrain.worker.protocol import StepReport


@dataclass
class Position:
    """Where the run stands: the last committed step and the data cursor after it (what checkpoints hold)."""

    step: int = 0
    cursor: int = 0

    def advance(self, batch: int) -> None:
        """A step of `batch` samples committed."""
        self.step, self.cursor = self.step + 1, self.cursor + batch


@dataclass
class Outcome:
    """What the loop learns from a step."""

    lost: list = field(default_factory=list)  # members lost: a recovery comes next
    since: float = 0.0  # when the failed step was dispatched (a recovery's "detect" starts there)
    diverged: bool = False  # a non-finite gradient: a rollback comes next
    cause: str = ""  # why members were lost (etrain/control/gather.py's WorkersLost)


@dataclass
class Sent:
    """A step given to the workers: its members and their shares, the outlier limit it is judged by, and when its
    wall time started (when it was sent, or when the step before it came back if it was sent ahead of that one)."""

    step: int
    workers: list
    shares: list[np.ndarray]
    batch: int
    limit: float
    refs: list
    started: float
    ahead: bool = False
    balance: Balance | None = None  # the split switched mode with this step (recorded as it commits)
    spans: list[list[int]] | None = None  # sent through node relays: the ranks each of `refs` answers for


class Stepper:
    """What a step of the run's mode is, for the coordinator (its spec names it: etrain/core/modes.py): the
    training step of the data-parallel, laid-out and DiLoCo modes here; PPO's (ppo_step.py) and parameter-server
    mode's (ps_mode.py) beside it."""

    def __init__(self, cfg: Config, mode: Mode, team, data, balancer, guards, faults, saver, log):
        self.cfg, self.mode, self.team, self.data, self.balancer = cfg, mode, team, data, balancer
        self.guards, self.faults, self.saver, self.log = guards, faults, saver, log
        self.tokens_per_sample = cfg.model.seq_len
        self.ahead: Sent | None = None  # the next step, sent before this one's reports came back

    def state(self) -> dict:
        """What checkpoints hold of the stepper (a PPO stepper's KL coefficient); none for training steps."""
        return {}

    def load(self, meta: dict) -> None:
        """Back to a checkpoint's `state()`."""

    def evaluate(self, faults: dict) -> tuple[float | None, float | None]:
        """The held-out loss over the members (`faults`: rank -> an injected fault, during: eval), and no reward.
        WorkersLost if a member is lost meanwhile: this evaluation is lost with it."""
        return evaluate(self.team, self.data.eval_ids, faults), None

    def evaluates_first(self, step: int) -> bool:
        """Whether the run measures its start before any step (PPO's base policy's reward): no."""
        return False

    def suspects(self) -> tuple[str, ...]:
        """What a non-finite gradient points at, beside the guards' own advice."""
        return ()

    def check_size(self, workers: int) -> None:
        """ValueError if this mode's steps cannot be split over `workers` members (a resize request)."""

    def close(self) -> None:
        """The stepper's own actors stopped (PPO's scorers); none here."""

    def run(self, at: Position) -> Outcome:
        n, workers = at.step + 1, self.team.workers
        sent = self.ahead if self.ahead is not None else self.send(n, at.cursor, workers)
        self.ahead = None
        if self.may_send_ahead(n, workers):  # the workers go on while this loop commits step n and decides
            self.ahead = self.send(n + 1, at.cursor + sent.batch, workers, ahead=True)
        try:
            queued = self.ahead.refs if self.ahead is not None else ()
            # at a failure the others end the step (the actor's `stop_step`), not waited for
            stop = partial(self.team.tell, workers, "stop_step", self.team.generation, n)
            reports: list[StepReport] = self.team.gather(
                sent.refs, workers, f"step {n}", queued=queued, stop=stop, spans=sent.spans
            )
        except WorkersLost as gone:
            self.drop_ahead()
            survivors = [done for w, done in zip(sent.workers, gone.finished) if w not in gone.lost]
            # their all-reduce had every share in it; not so in a DiLoCo window's inner steps (no all-reduce: what
            # the lost member learned is lost, and the window is redone from its start)
            if survivors and all(survivors) and self.cfg.outer_step(n):
                self.commit(at, sent.batch, None, 0.0)
            return Outcome(lost=gone.lost, since=sent.started, cause=f"step {n}: {gone.cause}")
        returned = time.perf_counter()
        if self.ahead is not None:
            self.ahead.started = returned
        if not all(r.finite for r in reports):
            self.drop_ahead()  # it stepped on weights the rollback replaces
            return Outcome(diverged=True)
        lead = reports[0]
        if lead.skipped:
            self.data.quarantine(n, np.concatenate(sent.shares[:: self.team.ranks]), lead.grad_norm, sent.limit)
            self.log.record(Outlier(n, lead.grad_norm, sent.limit, sent.batch, self.guards.reject(n)))
        else:
            self.guards.accept(n, lead.grad_norm)
        self.balancer.observe(sent.workers, [r.share for r in reports], [r.compute_s for r in reports])
        if sent.balance is not None:
            self.log.record(sent.balance)
        self.commit(at, sent.batch, reports, returned - sent.started, ahead=sent.ahead)
        return Outcome()

    def faults_due(self, n: int, cursor: int) -> dict[int, dict]:
        """The faults step `n` meets. At the run's last step one still held for a ready pool worker waits for one (up
        to timeouts.join_s): a drill's recovery is not lost because the pool, started after the first step, was
        still starting when the run ended."""
        if n == self.cfg.train.steps and self.faults.held(n) and not self.team.pool.ready():
            self.team.await_ready(1, Position(n - 1, cursor))
        return self.faults.due(n, self.team.pool.ready() > 0)

    def send(self, n: int, cursor: int, workers: list, ahead: bool = False) -> Sent:
        """Give step `n` (the batch at `cursor`) to `workers`."""
        batch, was_balanced = self.cfg.batch_at(len(workers)), self.balancer.balanced
        shares = self.shares(cursor, batch, workers)
        switched = self.balancer.balanced != was_balanced
        # DiLoCo: each worker's gradient is its own, no rank sees the group's norm to judge the batch by
        limit = self.guards.limit(n) if self.mode.judged else math.inf
        faults = self.faults_due(n, cursor)
        link = self.faults.link(n)
        work = {
            "global_batch": batch,
            "cursor": cursor,
            "lr_scale": self.guards.lr_scale,
            "max_norm": limit,
            "link": link,
        }
        balance = Balance(n, self.balancer.balanced, [len(s) for s in shares]) if switched else None
        works = [work | {"ids": ids} for ids in shares]
        if self.relayed(workers):
            nodes = [self.team.nodes[w] for w in workers]
            refs, spans = self.team.relays.step(
                n, self.team.generation, workers, nodes, works, faults, self.data.caches
            )
            return Sent(n, workers, shares, batch, limit, refs, time.perf_counter(), ahead, balance, spans)
        refs = [w.step.remote(n, works[rank], faults.get(rank)) for rank, w in enumerate(workers)]
        return Sent(n, workers, shares, batch, limit, refs, time.perf_counter(), ahead, balance)

    def relayed(self, workers: list) -> bool:
        """Whether a step goes to `workers` through node relays (relay.py)."""
        return self.team.relayed(len(workers))

    def may_send_ahead(self, n: int, workers: list) -> bool:
        """Whether step n + 1 can go to the workers before step n's reports are back: when nothing but another step
        can follow step n (no evaluation, save, end or resize is due after it, no fault at n + 1), in a mode whose
        spec allows it (data parallelism). A failure in step n discards it (`drop_ahead`): exactly once holds."""
        c = self.cfg
        return (
            c.train.send_ahead
            and self.mode.sends_ahead
            and not self.relayed(workers)
            and n < c.train.steps
            and not due(n, c.train.eval_every, c.train.steps, c.window)
            and self.saver.level(n) is None
            and not self.faults.pending(n + 1)
            and self.team.target() == len(workers)
            and not self.team.draining_members()
        )

    def drop_ahead(self) -> None:
        """Step n failed: the step sent after it is not committed. Its workers end it before anything else this
        loop asks of them (an actor runs its calls in order); what it did to their state, a recovery or a rollback
        replaces. Waited for a moment, so that its answer (most often an error: its group is gone) is read."""
        if self.ahead is None:
            return
        refs, self.ahead = self.ahead.refs, None
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.timeouts.ping_s)
        for ref in done:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
                pass

    def shares(self, cursor: int, batch: int, workers: list) -> list[np.ndarray]:
        """Each member's sample ids: split by measured speed where each member is a replica; otherwise split over the
        replicas (each share a whole number of pipeline micro-batches), every rank of a replica reading its
        replica's."""
        if self.mode.splits_by_speed:
            return order.plan_step(self.data.layout, cursor, batch, self.balancer.weights(workers))
        par = self.cfg.parallel
        per = par.per_replica
        counts = [c * per for c in order.split_counts(batch // per, [1.0] * par.replicas(len(workers)))]
        replicas = np.split(order.take(self.data.layout, cursor, batch), np.cumsum(counts)[:-1])
        return [replicas[par.place(rank).replica] for rank in range(len(workers))]

    def commit(
        self,
        at: Position,
        batch: int,
        reports: list[StepReport] | None,
        elapsed: float,
        extra: dict | None = None,
        ahead: bool = False,
    ) -> None:
        """The step is done: the cursor moves on, and its record is written (with `extra`: a PPO step's means; `ahead`:
        it was sent before the step before it came back), and a save in flight commits once its writers say they
        are done. Without reports when the survivors of a lost member committed it (their losses miss the lost
        one's share)."""
        at.advance(batch)
        workers = len(self.team.workers)
        record = Train(at.step, workers, batch, at.cursor, self.cfg.parallel.replicas(workers), extra=extra or {})
        if reports is not None:
            tokens_per_s = batch * self.tokens_per_sample / elapsed
            slowest = max(reports, key=lambda r: r.worker_s)  # the others waited for it
            record.loss, record.lr, record.grad_norm, record.skipped = (
                sum(r.loss for r in reports),
                reports[0].lr,
                reports[0].grad_norm,
                reports[0].skipped,
            )
            record.tokens_per_s, record.step_time_s, record.worker_s = tokens_per_s, elapsed, slowest.worker_s
            record.mfu = self.team.mfu(tokens_per_s, at.step)
            record.shares = [r.share for r in reports]
            record.speeds = [round(r.share / max(r.compute_s, 1e-9), 2) for r in reports]
            record.comm_bytes, record.dense_bytes = (
                sum(r.comm_bytes for r in reports),
                sum(r.dense_bytes for r in reports),
            )
            record.optimizer_bytes = [r.optimizer_bytes for r in reports]
            record.param_bytes, record.peak_rss = [r.param_bytes for r in reports], [r.peak_rss for r in reports]
            cost = self.data.cost([r.data for r in reports])
            record.data_wait_s, record.cache_hits, record.cache_misses = (
                cost["data_wait_s"],
                cost["cache_hits"],
                cost["cache_misses"],
            )
            record.fetched_bytes, record.fetched_shards = cost["fetched_bytes"], cost["fetched_shards"]
            # The step's wall time by part (STEP_PARTS), as the slowest worker spent it. "dispatch" is the wall time
            # beyond that worker's own: the call's way there and back, and the coordinator's loop while no step was
            # on the workers (none, when this step was sent ahead); "other" the worker's rest (its call's set-up,
            # reading its rows, its report). The checkpoint stall came before the step.
            record.sent_ahead = ahead
            record.compute_s, record.communication_s = slowest.compute_s, slowest.communication_s
            record.update_s = slowest.update_s
            record.dispatch_s = max(0.0, elapsed - slowest.worker_s)
            spent = slowest.compute_s + slowest.communication_s + record.data_wait_s + slowest.update_s
            record.other_s = max(0.0, min(elapsed, slowest.worker_s) - spent)
            record.checkpoint_stall_s = self.saver.stall
        self.saver.stall = 0.0
        self.log.record(record)
        if reports is not None:
            self.saver.observe([r.saving for r in reports])
        self.log.dashboard.pool(self.team.pool.ready())
        self.saver.stepped(at.step, at.cursor, batch)
        self.team.stepped()


def evaluate(team, eval_ids: np.ndarray, faults: dict | None = None) -> float | None:
    """The mean loss of the current weights on the held-out samples, split over the members (`faults`: rank -> an
    injected fault, during: eval). WorkersLost if a member is lost meanwhile: this evaluation is lost with it."""
    if not len(eval_ids):
        return None
    workers, par = team.workers, team.cfg.parallel
    replicas = par.replicas(len(workers))
    shares = order.split(eval_ids, [1.0] * replicas) if len(eval_ids) >= replicas else [eval_ids]
    shares = [shares[par.place(rank).replica] for rank in range(len(shares) * par.ranks)]  # a replica's ranks alike
    faults = faults or {}
    refs = [w.evaluate.remote({"ids": s}, faults.get(rank)) for rank, (w, s) in enumerate(zip(workers, shares))]
    results = team.gather(refs, workers, "evaluation")  # within timeouts.step_s, named when it runs out
    return sum(r[0] for r in results) / sum(r[1] for r in results)
