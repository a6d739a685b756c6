"""Coordinator: the control loop of one training job. Observe, decide (etrain/control/control.py, pure), act.

It runs as a Ray actor pinned to the driver's node (the run directory lives there), named
`etrain:RUN` so `etrain scale`, `etrain status` and notebooks can reach it. Each concern is
a module of its own, and this loop only sequences them:

    step.py          one step as a transaction (and an evaluation): the stepper of the run's mode
                     (etrain/core/modes.py names it: PPO's is ppo_step.py, parameter-server mode's ps_mode.py,
                     which drives that run itself: the one exception to the state machine)
    membership.py    the group, the warm pool, resizes and recoveries
    saving.py        checkpoints, and where a resume or a rollback lands
    data_plane.py    layout, node caches, data cost, quarantine
    runlog.py        records, dashboard, summary (status_file.py: status.json; run_status.py: `etrain status`)
    guards.py        outlier and NaN guards
    faults.py        failure injection
    health_watch.py  each node's failure risk, and drains before a failure

Every handler returns the members it lost (a Lost), if any: the next decision is then a recovery. Nothing here
tests which mode the run trains in: the mode's spec and its stepper say what differs.
"""

from __future__ import annotations

import time
from pathlib import Path

import ray

from etrain.control.balance import Balancer
from etrain.control.control import JobError, Observation, State, due, next_state
from etrain.control.data_plane import DataPlane
from etrain.control.faults import FaultPlan
from etrain.control.gather import WorkersLost
from etrain.control.guards import Guards
from etrain.control.health_watch import HealthWatch
from etrain.control.membership import Lost, Team, preempted_nodes, whole_replicas, worker_nodes
from etrain.control.outer_steps import OuterSteps
from etrain.control.run_status import status_of, wanted_size
from etrain.control.runlog import RunLog
from etrain.control.saving import RewindPoint, Saver
from etrain.control.status_file import StatusFile
from etrain.control.step import Position
from etrain.core.checkpoint import checkpoint_uri
from etrain.core.config import Config
from etrain.core.errors import why
from etrain.core.lease import Lease
from etrain.core.modes import mode_of
from etrain.core.records import START_PHASES, Eval, NanRollback, Rewind, Start


class Coordinator:
    def __init__(
        self,
        cfg_dict: dict,
        run_dir: str,
        manifest: str,
        started_at: float,
        workers: list,
        lease: Lease,
        connected_at: float | None = None,
    ):
        self.cfg = cfg = Config.model_validate(cfg_dict)
        self.mode = mode_of(cfg)
        self.run_dir = Path(run_dir)
        self.hint = f"resume with `etrain train --resume {self.run_dir}`"
        self.at = Position()
        self.phase, self.failure = State.STARTING, None  # the state machine's state; why the job failed, once it has
        self.log = RunLog(self.run_dir, cfg, started_at, lease)
        self.status_file = StatusFile(self.run_dir, self.status, self.log)
        self.data = DataPlane(cfg, manifest, self.run_dir)
        self.balancer = Balancer(cfg.balance)
        self.team = Team(cfg, manifest, workers, self.data, self.balancer, self.log, self.hint)
        self.saver = Saver(cfg, checkpoint_uri(cfg, self.run_dir), self.log.record, self.team.gather)
        self.guards = Guards(cfg.train)
        self.faults = FaultPlan(cfg.faults, self.log.record, [r["fault"] for r in self.log.history("fault")])
        self.health = HealthWatch(cfg, self.team, self.faults, self.log)
        parts = (cfg, self.mode, self.team, self.data, self.balancer, self.guards, self.faults, self.saver, self.log)
        self.stepper = self.mode.load_stepper()(*parts)
        self.outer = OuterSteps(cfg)
        self.lost: Lost | None = None  # members lost: the next decision is a recovery
        self.saved_step = self.evaluated_step = self.started_step = 0
        # when the start's phases ended (START_PHASES): the driver's start, Ray's, ... the first step's (a Start record)
        self.starting: list[float] | None = [started_at, connected_at or started_at]

    def run(self, resume: bool, restart_if_corrupt: bool = False) -> dict:
        """Train the run to its end (`resume`: from its newest checkpoint that verifies; `restart_if_corrupt`: from the
        start when every committed one fails verification, instead of stopping)."""
        self.restart_if_corrupt = restart_if_corrupt
        try:
            self.status_file.start()
            self.data.open()
            if self.mode.own_loop:
                self.phase = State.RUNNING
                self.stepper.drive(self, resume)
                self.phase = State.FINISHED
            else:
                self._start(resume)
                handlers = {
                    State.RUNNING: self._step,
                    State.EVALUATING: self.evaluate,
                    State.CHECKPOINTING: self.checkpoint,
                    State.RESIZING: self._resize,
                    State.RECOVERING: self._recover,
                }
                while (state := self._decide()) not in (State.FINISHED, State.FAILED):
                    self.lost = handlers[state]()
            self.saver.finish()
            if self.phase == State.FAILED:
                raise JobError(
                    f"lost workers more than cluster.max_recoveries={self.team.recoveries} times; {self.hint}"
                )
            return self.log.summary()
        except Exception as e:
            self.phase, self.failure = State.FAILED, str(e) if isinstance(e, JobError) else why(e)
            raise
        finally:
            self.status_file.write()
            self._stop()

    def _start(self, resume: bool) -> None:
        """Form the first group (and load the checkpoint of a resume). The warm pool starts after the first step: on
        a node it shares, a starting worker would slow that step (see Team.watch)."""
        marks = self.starting
        marks.append(time.time())
        join_s = self.cfg.timeouts.join_s
        if self.mode.placed_state:
            # DCP's reader, imported now in this thread, while the workers start: imported first in a recovery, torch's
            # distributed packages once raced an import in another of the actor's threads (ImportError: ShardedTensor)
            import etrain.core.sharded_checkpoint  # noqa: F401
        if not resume:  # each node's shard cache starts beside the workers' build: the first step's shard is there
            self.data.start_caches(worker_nodes(self.cfg.cluster) - preempted_nodes(), self.at.cursor)
        try:
            self.team.gather([w.info.remote() for w in self.team.workers], self.team.workers, "worker start", join_s)
            marks.append(time.time())
            self.team.form(self.team.workers, self.at, "start")
        except WorkersLost as gone:
            raise JobError(f"{gone} while the group first formed; start the job again") from None
        marks.append(time.time())
        if resume:
            started = time.perf_counter()
            point = self.saver.resume_point(self.cfg.hash(), self.restart_if_corrupt)
            if point.ckpt is not None:
                self._load_all(point.ckpt.parts, point.meta["step"])
            self._rewind(point, "resume", load_s=time.perf_counter() - started)
        marks.append(time.time())
        self.started_step = self.at.step  # what the start record is filed under: a rewind never moves it aside
        self.saved_step = self.evaluated_step = self.at.step
        if self.stepper.evaluates_first(self.at.step):
            self.evaluated_step = -1
        if (self.mode.start_checkpoint or self.cfg.comm.zero) and self.saver.last is None:
            self.lost = self.checkpoint()  # something to go back to when a worker is lost (see _needs_rollback)

    def resume_point(self) -> RewindPoint:
        """Where a resume lands (its newest checkpoint that verifies, or the start), the run rewound to it: what a
        stepper that drives its own run starts from."""
        point = self.saver.resume_point(self.cfg.hash(), self.restart_if_corrupt)
        self._rewind(point, "resume")
        return point

    def _decide(self) -> State:
        self.team.mark_nodes(self.health.watch(self.at.step), set(self.health.kept_off), self.health.replacements)
        self.team.watch(self.at)
        step, c = self.at.step, self.cfg
        obs = Observation(
            step=step,
            total_steps=c.train.steps,
            world=len(self.team.workers),
            target=self.team.target(),
            lost=len(self.lost.members) if self.lost else 0,
            recoveries=self.team.recoveries,
            max_recoveries=c.cluster.max_recoveries,
            evaluation_due=due(step, c.train.eval_every, c.train.steps, c.window) and self.evaluated_step != step,
            checkpoint_due=self.saver.level(step) is not None and self.saved_step != step,
            draining=self.team.draining_members(),
            outer_step=self.outer.start.step == step,
            in_flight=self.stepper.ahead is not None,
        )
        self.phase = next_state(self.phase, obs)
        return self.phase

    # -- the handlers: each returns the members it lost, if any -------------------------

    def _step(self) -> Lost | None:
        outcome = self.stepper.run(self.at)
        self.outer.stepped(self.at)
        if outcome.diverged:
            return self._roll_back_nan()
        if outcome.lost:
            return Lost(outcome.lost, outcome.since, outcome.cause)
        self.health.stepped(self.at.step, self.log.latest["train"].get("speeds"))
        if self.starting is not None:
            self._started()
        self.team.prepare_pool(self.at)
        return None

    def _started(self) -> None:
        """The first step committed: the start's phases, and the warm pool starts."""
        marks, self.starting = [*self.starting, time.time()], None
        phases = dict(zip(START_PHASES, (b - a for a, b in zip(marks, marks[1:]))))
        self.log.record(Start(self.started_step, phases, marks[-1] - marks[0]))
        self.team.refill()

    def evaluate(self) -> Lost | None:
        self.evaluated_step, started = self.at.step, time.perf_counter()
        try:
            loss, reward = self.stepper.evaluate(self.faults.due(self.at.step, during="eval"))
        except WorkersLost as gone:  # this evaluation is lost with them; the next comes after recovery
            return Lost(gone.lost, gone.since)
        if loss is not None:
            self.log.record(Eval(self.at.step, loss, reward, time.perf_counter() - started))
        return None

    def checkpoint(self) -> Lost | None:
        meta = {
            "cursor": self.at.cursor,
            "config_hash": self.cfg.hash(),
            "config": self.cfg.model_dump(),
            "world_size": len(self.team.workers),
            **self.guards.state(),
            **self.stepper.state(),
            "balance": self.balancer.state(self.team.workers),
        }
        try:
            self.saver.begin(self.at.step, self.team.workers, meta)
        except WorkersLost as gone:  # saved again once the group has recovered
            return Lost(gone.lost, gone.since)
        self.saved_step = self.at.step
        return None

    def _resize(self) -> Lost | None:
        self.saver.finish()  # writers may be leaving
        self._to_outer_step("a drain")
        try:
            whole = self.team.consolidate() if self._sharded() else None  # before anyone leaves: every shard is needed
        except WorkersLost as gone:  # a member is gone: recovery goes back to the last checkpoint
            return Lost(gone.lost, gone.since)
        return self.team.resize(self.at, whole)

    def _recover(self) -> Lost | None:
        """With ZeRO-1 the lost workers took their optimizer shards along, in a PPO step the survivors may have
        made some of its updates, and with a layout whose every replica lost a rank no live twin holds the lost
        ranks' parts: everyone goes back to the last checkpoint."""
        self.saver.finish()  # a lost writer fails it; the others' parts are of a good step
        self._to_outer_step("a lost worker")
        whole = None
        if why := self._needs_rollback():
            point = self.saver.rollback_point(self.cfg.hash(), why, self.hint)
            self._rewind(point, "rollback")
            whole = ray.put(point.ckpt.parts)
        return self.team.recover(self.lost, self.at, whole)

    def _needs_rollback(self) -> str | None:
        """Why the lost members' state can only come from the last checkpoint, if it can only come from there."""
        if self.mode.rolls_back:
            return self.mode.rolls_back
        if self._sharded():
            return "a worker lost with its ZeRO-1 optimizer shard"
        if not whole_replicas(self.team.workers, self.lost.members, self.team.ranks)[0]:
            cause = f"; {self.lost.cause}" if self.lost.cause else ""
            return f"every worker lost, or a rank of every replica (no live worker holds the state{cause})"
        return None

    def _roll_back_nan(self) -> Lost | None:
        """A non-finite gradient (nobody stepped): back to the last checkpoint with the lr halved."""
        failed = self.at.step + 1
        self.guards.diverged(failed, self.hint, *self.stepper.suspects())
        point = self.saver.rollback_point(self.cfg.hash(), "a non-finite gradient", self.hint)
        self._rewind(point, "rollback")
        self._load_all(point.ckpt.parts, self.at.step)
        self.log.record(NanRollback(failed, self.at.step, self.guards.lr_scale))
        return None

    # -- the rest -----------------------------------------------------------------

    def _rewind(self, point: RewindPoint, kind: str, load_s: float | None = None) -> None:
        """The position to the checkpoint's (the start without one), its guards and split with it; the
        records of the steps after it move aside, so whatever the run directory held, no step is recorded twice."""
        meta = point.meta
        reached = (self.saver.reached() or meta["step"]) if kind == "resume" else self.at.step
        self.at.step, self.at.cursor = meta["step"], meta["cursor"]
        self.saved_step = self.evaluated_step = self.at.step
        self.outer.landed(self.at)
        self.saver.rewound(point)
        self.guards.load(meta, resume=kind == "resume")
        self.stepper.load(meta)
        if kind == "resume":
            self.balancer.load(meta.get("balance"), self.team.workers)
        ckpt = point.ckpt
        path, base = (ckpt.path, ckpt.base) if ckpt else (None, None)
        redone = self.log.rewind(self.at.step)
        rewind = Rewind(self.at.step, kind, path, meta["level"], base, point.reason, reached, redone, load_s)
        rewind.skipped = point.skipped or None
        self.log.record(rewind)

    def _to_outer_step(self, why: str) -> None:
        """DiLoCo: a change of members between outer steps goes back to the last one. The survivors redo the window's
        inner steps with the new group (each worker restores its state of that step as it rejoins: worker/diloco.py),
        and the cursor goes back with them, so every sample still counts once."""
        start = self.outer.start
        if start.step == self.at.step:
            return
        reached = self.at.step
        self.at.step, self.at.cursor = start.step, start.cursor
        self.saved_step, self.evaluated_step = min(self.saved_step, start.step), min(self.evaluated_step, start.step)
        reason = f"{why} between outer steps: the window is redone"
        self.log.record(
            Rewind(start.step, "outer", None, None, None, reason, reached, self.log.rewind(start.step), None)
        )

    def _load_all(self, parts: dict, step: int) -> None:
        """Every member takes a checkpoint's state (`parts`, at `step`): a member lost meanwhile fails the job."""
        shared = ray.put(parts)
        self.gather_all([w.load_state.remote(shared, step) for w in self.team.workers], "state load")

    def gather_all(self, refs: list, what: str) -> list:
        """Every member's answer where no recovery is possible (a state load): a lost member fails the job."""
        try:
            return self.team.gather(refs, self.team.workers, what, self.cfg.timeouts.join_s)
        except WorkersLost as gone:
            raise JobError(f"{gone}; {self.hint}") from None

    def _sharded(self) -> bool:
        return self.cfg.comm.zero and len(self.team.workers) > 1

    def _stop(self) -> None:
        self.health.close()
        self.status_file.close()
        self.log.close()
        self.saver.close()
        self.team.stop()
        self.stepper.close()
        self.data.close(self.cfg.timeouts.close_s)

    # -- driver- and user-facing ---------------------------------------------------

    def poll(self) -> tuple[str, list[dict]]:
        """The phase and the records written since the last poll."""
        return self.phase.value, self.log.poll()

    def status(self) -> dict:
        """Where the run stands (`etrain status`, the Python API, status.json)."""
        return status_of(self)

    def request_scale(self, workers: int | None = None, replicas: int | None = None) -> None:
        """Ask for `workers` members, or `replicas` replicas of tp × pp × shard members; they join at step boundaries as
        ready workers allow. A manual request pins the size: the autoscaling policy stops for this run."""
        self.team.request(wanted_size(self, workers, replicas))
