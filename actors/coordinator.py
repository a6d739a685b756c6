"""Coordinator: drives the workers and owns the global cursor, the step loop and the run's records.

It runs as a Ray actor pinned to the driver's node (the run directory lives
there), named `etrain:RUN` so `etrain scale` and notebooks can reach it. The
loop is the state machine of actors.control: observe, decide (pure), act.

Each step is a transaction: the cursor advances only when the step's
all-reduce completed on every member. Membership changes happen between
steps and keep the live actors: lost workers are replaced from the warm pool,
joiners get the state of a live peer, the group is re-formed under a new store
prefix, and the remaining samples are re-split. No restart, no checkpoint load.

Checkpoint state reaches the coordinator as bytes; it loads the worker class
(and torch) only because Ray does so for the worker handles it receives.
"""

from __future__ import annotations

import logging
import math
import posixpath
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.balance import Balancer
from actors.control import JobError, Observation, State, autoscale, next_state, pool_size
from actors.dashboard import Dashboard
from actors.guards import NormWatch
from actors.pool import WarmPool
from actors.ps_mode import PSTraining
from actors.saving import Saver
from app.core.checkpoint import checkpoint_uri
from app.core.config import Config
from app.core.errors import why
from app.core.flops import flops_per_token, mfu
from app.core.lease import Keeper, Lease
from app.core.records import append_jsonl, eta_s, summarize, truncate_after, write_json
from pipelines import order
from pipelines.cache import ShardCache
from pipelines.shards import read_manifest, row_sources

log = logging.getLogger(__name__)

PING_S = 2.0  # a live worker answers `info` at once; one that does not is hung or gone
WATCH_S = 1.0  # how often the cluster is looked at: preemption notices, free room for autoscaling
STATUS_S = 1.0  # how often status.json is rewritten while records come
STATS_S = 0.05  # how long a step waits for the node caches' counts
ATTACH_S = 0.2  # how long the loop waits for a warm pool worker's cache attach (most take ~50 ms)


class StepFailed(Exception):
    """A step did not complete on every member; `lost` are the members that are gone."""

    def __init__(self, lost: list, committed: bool, since: float):
        super().__init__(f"{len(lost)} worker(s) lost")
        self.lost, self.committed, self.since = lost, committed, since


class MembersLost(Exception):
    """Members died while the group was being changed (a spot node can go at any moment)."""

    def __init__(self, lost: list):
        super().__init__(f"{len(lost)} worker(s) lost")
        self.lost = lost


class Coordinator:
    def __init__(self, cfg_dict: dict, run_dir: str, manifest: str, started_at: float, workers: list, lease: Lease):
        self.cfg = Config.model_validate(cfg_dict)
        self.run_dir = Path(run_dir)
        self.started_at = started_at
        self.ckpt_uri = checkpoint_uri(self.cfg, self.run_dir)
        splits = read_manifest(manifest)["splits"]
        sizes = tuple(s["samples"] for s in splits["train"]["shards"])
        self.shard_paths = [s["path"] for s in splits["train"]["shards"]]  # to name a quarantined sample's source
        self.layout = order.Layout(self.cfg.train.seed, sizes, self.cfg.data.shuffle_shards)
        # A fixed held-out subset (seed 0, not the training seed) so runs and trials compare.
        num_eval = splits["eval"]["samples"]
        self.eval_ids = order.take(order.Layout(0, (num_eval,), 1), 0, min(self.cfg.train.eval_samples, num_eval))
        self.manifest = manifest
        self.caches: dict[str, object] = {}  # node id -> ShardCache actor
        self._fetched: dict[str, dict] = {}  # node -> its cache's last stats (what it had fetched)
        self.pool = WarmPool(self.cfg, manifest, self._retire)
        self.step = self.cursor = self.saved_step = 0
        self.generation = 0
        self.workers = workers
        self.wanted = len(workers)  # asked for by `etrain scale` or the autoscaling policy
        self.autoscaling = self.cfg.cluster.max_workers is not None
        self.nodes: dict = {}  # worker -> node id, for members and prepared pool workers
        self.pids: dict = {}  # worker -> process id, for members (status shows where each rank runs)
        self.draining: set[str] = set()  # nodes with a preemption notice
        self._next_watch = 0.0
        self.lost: list = []
        self.balancer = Balancer(self.cfg.balance)
        self.lr_scale = 1.0  # halved by each rollback after a non-finite gradient
        self.norms = NormWatch()  # accepted gradient norms: the outlier guard's limit
        self.nan_rollbacks = 0
        self.saver = Saver(self.cfg, self.ckpt_uri, self._record)
        self.recoveries = 0
        self.fired: set[int] = set()  # indexes into cfg.faults
        self.phase = State.STARTING
        self.first_step_at: float | None = None
        self._pending_event: dict | None = None  # a membership change waiting for its first step
        self._failed_since = 0.0
        self._attached: set = set()  # workers reading through their node's cache
        self._lock = threading.Lock()
        self._events: list[dict] = []
        self.dashboard = Dashboard(self.run_dir.name)
        self.peaks: dict = {}  # worker -> its measured matmul FLOP/s (MFU's denominator)
        self.flops_per_token = 0.0
        self._mfu_warned = False  # MFU above 1 is said once
        self._stall = 0.0  # the checkpoint stall since the last step
        self.latest: dict[str, dict] = {}  # the last record of each kind (status shows them)
        self._commits: deque = deque(maxlen=20)  # recent step commit times: the ETA
        self._status_due = 0.0  # when status.json is written next
        self.failure: str | None = None  # why the job failed, once it has
        self.keeper = Keeper(lease)  # the run's lease, renewed where its records are written: a frozen driver keeps it

    # -- driver- and user-facing ----------------------------------------------

    def run(self, resume: bool) -> dict:
        try:
            if self.cfg.comm.mode == "ps":
                self._train_ps(resume)
                self.saver.finish()
                return self._summary()
            try:
                self._form(self.workers, reason="start")
            except MembersLost as gone:
                raise JobError(f"{gone} while the group first formed; start the job again") from None
            if resume:
                self._restore()
            self.saved_step = self.step
            if self.cfg.comm.zero and self._latest_checkpoint() is None:
                self._checkpoint()  # something to go back to when a worker is lost with its optimizer shard
            self._refill()
            handlers = {State.RUNNING: self._run_step, State.CHECKPOINTING: self._checkpoint, State.RESIZING: self._resize, State.RECOVERING: self._recover}
            while (state := self._decide()) not in (State.FINISHED, State.FAILED):
                handlers[state]()
            self.saver.finish()
            if state == State.FAILED:
                raise JobError(f"lost workers more than cluster.max_recoveries={self.recoveries} times; resume with `etrain train --resume {self.run_dir}`")
            return self._summary()
        except Exception as e:
            self.phase, self.failure = State.FAILED, str(e) if isinstance(e, JobError) else why(e)
            raise
        finally:
            self._write_status()
            self._stop()

    def _train_ps(self, resume: bool) -> None:
        """Parameter-server mode (actors/ps_mode.py): no process group, no step barrier."""
        infos = self._gather([w.info.remote() for w in self.workers], "worker start", self.cfg.timeouts.join_s)
        self._note_members(self.workers, infos)
        self._attach_caches(self.workers, [i["node"] for i in infos])
        ckpt = self._latest_checkpoint() if resume else None
        if resume:
            self._rewind(ckpt, "resume")
        self.phase = State.RUNNING
        ps = PSTraining(self)
        try:
            ps.start(ckpt.parts if ckpt is not None else None)
            ps.run()
        finally:
            ps.close()
        self.phase = State.FINISHED

    def poll(self) -> tuple[str, list[dict]]:
        """Phase and the records produced since the last poll."""
        with self._lock:
            events, self._events = self._events, []
        return self.phase.value, events

    def status(self) -> dict:
        """Where the run stands (the Python API and `etrain scale` show this)."""
        members = [
            {"rank": r, "node": self.nodes[w], "pid": self.pids[w], "speed": self.balancer.speeds.get(w)} for r, w in enumerate(self.workers) if w in self.pids
        ]
        with self._lock:
            train, evaluated, saved = (self.latest.get(k, {}) for k in ("train", "eval", "checkpoint"))
            eta = eta_s(list(self._commits), self.cfg.train.steps - self.step)
        return {
            "run": self.run_dir.name,
            "run_dir": str(self.run_dir),
            "phase": self.phase.value,
            "failure": self.failure,
            "step": self.step,
            "total_steps": self.cfg.train.steps,
            "eta_s": eta,
            "elapsed_s": time.time() - self.started_at,
            "loss": train.get("loss"),
            "eval_loss": evaluated.get("eval_loss"),
            "tokens_per_s": train.get("tokens_per_s"),
            "mfu": train.get("mfu"),
            "last_checkpoint": {k: saved[k] for k in ("step", "level", "path")} if saved else None,
            "world_size": len(self.workers),
            "wanted": self.wanted,
            "autoscaling": self.autoscaling,
            "warm_pool_ready": self.pool.ready(),
            "warm_pool_size": len(self.pool.idle),
            "recoveries": self.recoveries,
            "generation": self.generation,
            "draining_nodes": sorted(self.draining),
            "balanced": self.balancer.balanced,
            "comm": self.cfg.comm.mode,
            "members": members,
        }

    def request_scale(self, workers: int) -> None:
        """Ask for `workers` members; they join at step boundaries as ready workers allow.
        A manual request pins the size: the autoscaling policy stops for this run."""
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if self.cfg.comm.mode == "ps":
            raise ValueError("a parameter-server run (comm.mode=ps) keeps its workers: it cannot be resized")
        if self.cfg.train.batch_scaling == "constant" and workers > self.cfg.train.global_batch:
            raise ValueError(f"workers must not exceed train.global_batch={self.cfg.train.global_batch} (every worker needs a sample), got {workers}")
        self.wanted, self.autoscaling = workers, False

    # -- the loop ---------------------------------------------------------------

    def _decide(self) -> State:
        self._watch_cluster()
        obs = Observation(
            step=self.step,
            total_steps=self.cfg.train.steps,
            world=len(self.workers),
            target=self._target(),
            lost=len(self.lost),
            recoveries=self.recoveries,
            max_recoveries=self.cfg.cluster.max_recoveries,
            checkpoint_due=self.saver.level(self.step) is not None and self.saved_step != self.step,
            evict=sum(self.nodes.get(w) in self.draining for w in self.workers),
        )
        self.phase = next_state(self.phase, obs)
        return self.phase

    def _target(self) -> int:
        """The world size the next step boundary can reach: shrinking at once, growing by ready pool workers only."""
        world = len(self.workers)
        return self.wanted if self.wanted <= world else world + min(self.wanted - world, self.pool.ready())

    def _watch_cluster(self) -> None:
        """Preemption notices (nodes being drained), new nodes (their shard cache starts at once, beside the
        workers starting there) and, when autoscaling, room for more workers: once a second, and the room
        also at every step boundary where a ready pool worker could join."""
        if self.autoscaling and self.pool.ready() and len(self.workers) < self.cfg.cluster.max_workers:
            self._autoscale()
        if time.monotonic() < self._next_watch:
            return
        self._next_watch = time.monotonic() + WATCH_S
        self.draining = draining_nodes()
        self.pool.drop([w for w in self.pool.idle if self.nodes.get(w) in self.draining])
        self._start_caches(worker_nodes(self.cfg.cluster) - self.draining)
        if self._pending_event is None:  # not while a change waits for its first step: a starting worker would slow it
            self._refill()
        if self.autoscaling:
            self._autoscale()

    def _autoscale(self) -> None:
        before, world = self.wanted, len(self.workers)
        c = self.cfg.cluster
        self.wanted = autoscale(world, self._free_slots(), self.pool.ready(), len(self.pool.idle), c.max_workers, c.warm_pool)
        if self.wanted != before:
            self._record({"kind": "autoscale", "step": self.step, "world": world, "wanted": self.wanted, "time": time.time()})

    def _free_slots(self) -> int:
        """Workers the cluster has room for now, beyond the pool (its workers still starting count as placed)."""
        c = self.cfg.cluster
        free = ray.available_resources()
        slots = int(free.get("CPU", 0) // c.cpus_per_worker)
        if c.gpus_per_worker:
            slots = min(slots, int(free.get("GPU", 0) // c.gpus_per_worker))
        return max(0, slots - len(self.pool.warming))

    def _refill(self) -> None:
        """Pool back to its size; the autoscaler asked for room."""
        self.pool.refill(self._pool_size())
        self.pool.reserve(self.cfg.cluster.max_workers if self.autoscaling else max(self.wanted, len(self.workers)))

    def _pool_size(self) -> int:
        max_workers = self.cfg.cluster.max_workers if self.autoscaling else None
        # Room is counted once the pool's starting workers have started: Ray's view of free resources lags
        # their placement, and a second cold start beside one still going slows both.
        free = self._free_slots() if self.autoscaling and not self.pool.warming else 0
        return pool_size(len(self.workers), self.wanted, free, len(self.pool.idle), self.cfg.cluster.warm_pool, max_workers)

    def _run_step(self) -> None:
        try:
            self._train_step()
        except StepFailed as failed:
            self.lost, self._failed_since = failed.lost, failed.since
            if failed.committed:
                self._commit(None, None)
            return
        self._maybe_evaluate()
        self._prepare_pool()

    def _prepare_pool(self) -> None:
        """Attach pool workers that finished warming up to their node's cache while they wait. The attach is
        waited for a moment (the node's cache has the shard already, most often: then the worker can join
        at this step boundary), not longer: a slow download must not hold up training."""
        for worker in self.pool.newly_ready():
            try:
                self.nodes[worker] = node = ray.get(worker.info.remote(), timeout=PING_S)["node"]
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:  # died starting: the next refill replaces it
                log.warning("a warm-pool worker did not start: %s", why(e))
                self.pool.drop([worker])
                continue
            if node in self.draining:  # started on a node with a preemption notice: no use waiting there
                self.pool.drop([worker])
                continue
            self.pool.preparing[worker] = attach = self._attach_caches([worker], [node], cursor=self.cursor, wait=False)[0]
            ray.wait([attach], timeout=ATTACH_S)

    def _train_step(self) -> None:
        """Take the next global batch, split it over the workers by speed, commit when all finished."""
        started = time.perf_counter()
        batch = self.cfg.batch_at(len(self.workers))
        was_balanced = self.balancer.balanced
        weights = self.balancer.weights(self.workers)
        shares = order.plan_step(self.layout, self.cursor, batch, weights)
        faults = self._faults_for(self.step + 1)
        limit = self.norms.limit(self.cfg.train.outlier_sigmas, self.cfg.train.outlier_warmup)
        refs = [
            w.train_step.remote(self.step, s, batch, self.cursor, faults.get(rank), self.lr_scale, limit)
            for rank, (w, s) in enumerate(zip(self.workers, shares))
        ]
        results = self._collect(refs, started)
        if not all(r["finite"] for r in results):
            self._diverged()
            return
        if results[0]["skipped"]:
            self._quarantine(np.concatenate(shares), results[0]["grad_norm"], limit)
        elif math.isfinite(results[0]["grad_norm"]):  # fp16: an overflow the scaler skipped says nothing
            self.norms.add(results[0]["grad_norm"])
        for worker, result in zip(self.workers, results):
            self.balancer.observe(worker, result["samples"], result["compute_s"])
        self.saver.observe(results)
        if self.balancer.balanced != was_balanced:
            self._record(
                {"kind": "balance", "step": self.step + 1, "balanced": self.balancer.balanced, "shares": [len(s) for s in shares], "time": time.time()}
            )
        self._commit(results, time.perf_counter() - started)

    def _diverged(self) -> None:
        """A non-finite gradient (nobody stepped): back to the last checkpoint with the lr halved, a bounded number of times."""
        failed = self.step + 1
        self.nan_rollbacks += 1
        if self.nan_rollbacks > self.cfg.train.max_nan_rollbacks:
            raise JobError(
                f"the gradient at step {failed} is not finite after {self.cfg.train.max_nan_rollbacks} rollbacks "
                f"(train.max_nan_rollbacks), each halving the lr; lower optim.lr or check the data, "
                f"then resume with `etrain train --resume {self.run_dir}`"
            )
        self.lr_scale /= 2
        whole = self._rollback("a non-finite gradient")
        self._gather([w.load_state.remote(whole, self.step) for w in self.workers], "state load", self.cfg.timeouts.join_s)
        self._record({"kind": "nan_rollback", "step": failed, "to_step": self.step, "lr_scale": self.lr_scale, "time": time.time()})

    def _quarantine(self, ids, grad_norm: float, limit: float) -> None:
        """An outlier step's samples, with the shard and row each came from, to the run's quarantine log."""
        shards = self.layout.shard_of(ids)
        rows = ids - self.layout.starts[shards]
        sources = [{"sample": int(i), "shard": self.shard_paths[s], "row": int(r)} for i, s, r in zip(ids, shards, rows)]
        for s in np.unique(shards):  # the documents each row was packed from (the shard's `sources` column)
            mine = np.flatnonzero(shards == s)
            docs = row_sources(posixpath.join(posixpath.dirname(self.manifest), self.shard_paths[s]), rows[mine])
            for k, names in zip(mine, docs or []):
                sources[k]["documents"] = names
        append_jsonl(self.run_dir / "quarantine.jsonl", {"step": self.step + 1, "grad_norm": grad_norm, "limit": limit, "samples": sources})
        restarted = self.norms.reject(self.cfg.train.outlier_patience)
        self._record(
            {
                "kind": "outlier",
                "step": self.step + 1,
                "grad_norm": grad_norm,
                "limit": limit,
                "samples": len(ids),
                "guard_restarted": restarted,
                "time": time.time(),
            }
        )

    def _commit(self, results: list[dict] | None, elapsed: float | None) -> None:
        batch = self.cfg.batch_at(len(self.workers))  # the membership that ran the step: changes come after
        self.step += 1
        self.cursor += batch
        self.first_step_at = self.first_step_at or time.time()
        record = {"kind": "train", "step": self.step, "world_size": len(self.workers), "batch": batch, "samples": self.cursor, "time": time.time()}
        if results is not None:  # None: committed by survivors whose all-reduce had every share in it
            tokens = batch * self.cfg.model.seq_len
            record |= {
                "loss": sum(r["loss"] for r in results),
                "lr": results[0]["lr"],
                "grad_norm": results[0]["grad_norm"],
                "skipped": results[0]["skipped"],
                "tokens_per_s": tokens / elapsed,
                "step_time_s": elapsed,
                "worker_s": max(r["worker_s"] for r in results),
                "mfu": self.mfu(tokens / elapsed),
                "shares": [r["samples"] for r in results],
                "speeds": [round(r["samples"] / max(r["compute_s"], 1e-9), 2) for r in results],
                "comm_bytes": sum(r["comm_bytes"] for r in results),
                "dense_bytes": sum(r["dense_bytes"] for r in results),
                "optimizer_bytes": [r["optimizer_bytes"] for r in results],
                **self._data_metrics([r["data"] for r in results]),
            }
            record |= self._step_parts(results, elapsed, record["data_wait_s"])
        self._stall = 0.0
        self._record(record)
        self.dashboard.pool(self.pool.ready())
        self.saver.stepped({"step": self.step, "cursor": self.cursor, "batch": batch, "time": record["time"]})
        self._close_event(stepped=True)

    def mfu(self, tokens_per_s: float) -> float | None:
        value = mfu(self.flops_per_token, tokens_per_s, [self.peaks[w] for w in self.workers])
        if value is None and None not in self.peaks.values() and not self._mfu_warned:
            self._mfu_warned = True
            self._record(
                {
                    "kind": "warning",
                    "step": self.step + 1,
                    "time": time.time(),
                    "text": "MFU above 100%: the device peak (app/flops.py) is wrong for this device; MFU is left out of the records",
                }
            )
        return value

    def _step_parts(self, results: list[dict], elapsed: float, data_wait: float) -> dict:
        """The step's wall time by part, as the slowest worker spent it (the others waited for it);
        "other" is the rest: dispatch, the optimizer update, the commit. The checkpoint stall came before the step."""
        slowest = max(results, key=lambda r: r["worker_s"])
        parts = {"compute_s": slowest["compute_s"], "communication_s": slowest["comm_s"], "data_wait_s": data_wait}
        return parts | {"other_s": max(0.0, elapsed - sum(parts.values())), "checkpoint_stall_s": self._stall}

    def _close_event(self, stepped: bool) -> None:
        """Record the pending membership change; its first_step phase only if a step followed it
        (a change can follow another at once, e.g. a preemption shrink, then a ready worker's join)."""
        if self._pending_event is None:
            return
        event, self._pending_event = self._pending_event, None
        if stepped:
            event["phases"]["first_step"] = time.perf_counter() - event["_started"] - sum(event["phases"].values())
        del event["_started"]
        event["total_s"] = sum(event["phases"].values())
        self._record(event)

    def _collect(self, refs: list, started: float) -> list[dict]:
        """Every member's result, or StepFailed naming the lost ones (dead, or hung past the timeouts).

        The first error ends the wait: survivors of a dead or hung peer fail their all-reduce within
        `timeouts.collective_s`, so nobody waits out `timeouts.step_s` for a worker that is gone.
        """
        results: dict = {}
        pending, failed = list(refs), None
        deadline = time.perf_counter() + self.cfg.timeouts.step_s
        while pending and not failed and time.perf_counter() < deadline:
            done, pending = ray.wait(pending, num_returns=1, timeout=deadline - time.perf_counter())
            for ref in done:
                try:
                    results[ref] = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                    failed = failed or e
        if not failed and not pending:
            return [results[r] for r in refs]
        cause = getattr(failed, "cause", failed) if failed else f"no result within timeouts.step_s={self.cfg.timeouts.step_s}"
        lost = self._find_lost(f"step {self.step + 1}", cause)
        survivors = [ref for w, ref in zip(self.workers, refs) if w not in lost]
        # Survivors that finished had every share in their all-reduce; with no survivor, nobody finished the step.
        survivors_done = bool(survivors) and all(ref in results for ref in survivors)
        raise StepFailed(lost, committed=survivors_done, since=started)

    def _find_lost(self, what: str, why, among: list | None = None) -> list:
        """The members (default: the group) that are dead or hung. None of them means `what` failed
        on live workers, which no replacement would mend: a JobError saying `why`."""
        pings = {w: w.info.remote() for w in (self.workers if among is None else among)}
        lost = []
        for worker, ref in pings.items():
            try:
                ray.get(ref, timeout=PING_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self._retire([worker])  # a hung one would block the next group too
                lost.append(worker)
        if not lost:
            raise JobError(f"{what} failed on live workers: {why}")
        return lost

    def _retire(self, workers: list) -> None:
        """Stop workers for good, and release the shard-cache pins they held (a killed reader cannot)."""
        for w in workers:
            ray.kill(w)
            for cache in self.caches.values():  # a reader's holder name is its actor id (no public accessor on a handle)
                cache.release_holder.remote(w._actor_id.hex())

    def _faults_for(self, step: int) -> dict[int, dict]:
        due = {i: f for i, f in enumerate(self.cfg.faults) if f.step == step and i not in self.fired}
        self.fired |= set(due)
        return {f.rank: f.model_dump() for f in due.values()}

    # -- membership ---------------------------------------------------------------

    def _recover(self) -> None:
        """Survivors plus ready pool workers redo the step; fewer if the pool is short (more join when ready).
        With ZeRO-1 the lost workers took their optimizer shards along: everyone goes back to the last checkpoint."""
        started = self._failed_since  # "detect" spans the failed step, from its dispatch to the lost list
        self.saver.finish()  # a lost writer fails it; the others' parts are of a good step
        survivors = [w for w in self.workers if w not in self.lost]
        self.recoveries += 1
        whole = self._rollback("a worker lost with its ZeRO-1 optimizer shard") if self._sharded() else None
        self._change(survivors, self.wanted - len(survivors), reason="recover", lost=len(self.lost), started=started, whole=whole)
        self.lost = []

    def _resize(self) -> None:
        """Members on draining nodes leave (preemption); then shrink to, or grow towards, the target."""
        started = time.perf_counter()
        self.saver.finish()  # writers may be leaving
        target = self._target()
        whole = self._consolidate() if self._sharded() else None  # before anyone leaves: every shard is needed
        if self._sharded() and whole is None:
            return  # a member is gone: the next decision is a recovery
        evicted = [w for w in self.workers if self.nodes.get(w) in self.draining]
        staying = [w for w in self.workers if w not in evicted]
        keep, leaving = staying[:target], staying[target:]
        self._retire(evicted)  # its node is going away: no clean exit needed, and it may be gone already
        try:
            self._gather_form([w.leave.remote() for w in leaving], "group exit", leaving)
        except MembersLost as gone:  # a leaver that died is simply not given back
            leaving = [w for w in leaving if w not in gone.lost]
        self.pool.give_back(leaving, keep=max(self._pool_size(), self.cfg.cluster.warm_pool + target - len(keep)))
        reason = "preemption" if evicted else "scale-in" if target < len(self.workers) else "scale-out"
        self._change(keep, target - len(keep), reason=reason, started=started, lost=len(evicted), whole=whole)

    def _change(self, members: list, joining: int, reason: str, started: float, lost: int = 0, whole=None) -> None:
        """Re-form the group as `members` plus up to `joining` ready pool workers; log each phase."""
        phases = {"detect": time.perf_counter() - started}
        t = time.perf_counter()
        joiners = self.pool.take(joining) if joining > 0 else []
        phases["acquire"] = time.perf_counter() - t
        self._close_event(stepped=False)
        event = {
            "kind": "membership",
            "reason": reason,
            "step": self.step,
            "world_before": len(self.workers),
            "world_after": len(members) + len(joiners),
            "lost": lost,
            "joiners": len(joiners),
            "joiner_nodes": [self.nodes.get(w) for w in joiners],
            "draining_nodes": sorted(self.draining),
        }
        if not members + joiners:
            raise JobError(f"no worker left and none ready in the warm pool; resume with `etrain train --resume {self.run_dir}`")
        self.balancer.forget(members + joiners)
        try:
            self._form(members + joiners, reason=reason, phases=phases, whole=whole)
        except MembersLost as gone:  # the next decision is a recovery, with the members still alive
            self.workers, self.lost, self._failed_since = members + joiners, gone.lost, time.perf_counter()
            log.warning("%d worker(s) lost during a %s at step %d; recovering", len(gone.lost), reason, self.step)
            return
        self._pending_event = {**event, "phases": phases, "_started": started}  # the pool refills after its first step

    def _sharded(self) -> bool:
        return self.cfg.comm.zero and len(self.workers) > 1

    def _consolidate(self):
        """ZeRO-1: the whole state, gathered from the current group's optimizer shards (a ref, from rank 0).
        None if a member is gone (a preempted node may be): then recovery goes back to the last checkpoint."""
        refs = [w.state.remote() for w in self.workers]
        return refs[0] if self._gather_members(refs, "gathering the ZeRO-1 optimizer state") is not None else None

    def _gather_members(self, refs: list, what: str) -> list | None:
        """Every member's answer between steps, or None when a member is gone (spot loss can strike
        at any moment): `self.lost` names it, and the next decision is a recovery."""
        try:
            return ray.get(refs, timeout=self.cfg.timeouts.step_s)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as e:
            self._failed_since, self.lost = time.perf_counter(), self._find_lost(what, getattr(e, "cause", e))
            log.warning("%s at step %d: %d worker(s) lost; recovering", what, self.step, len(self.lost))
            return None

    def _rollback(self, why: str):
        """Back to the last committed checkpoint: its parts as a ref; the cursor and records follow."""
        ckpt = self._latest_checkpoint()
        if ckpt is None:
            raise JobError(
                f"{why} needs a checkpoint to go back to, and there is none under {self.ckpt_uri} yet; "
                f"set checkpoint.every lower, then resume with `etrain train --resume {self.run_dir}`"
            )
        self._rewind(ckpt, "rollback")
        return ray.put(ckpt.parts)

    def _form(self, members: list, reason: str, phases: dict | None = None, whole=None) -> None:
        """Make `members` the group at the current step: caches, state from a live peer (or `whole`,
        a state every member loads after leaving the old group: ZeRO-1 re-shards it), new generation."""
        phases = phases if phases is not None else {}
        t = time.perf_counter()
        infos = self._gather_form([w.info.remote() for w in members], "worker start", members)
        self._note_members(members, infos)
        fresh = [(w, i["node"]) for w, i in zip(members, infos) if w not in self._attached]
        self._attach_caches([w for w, _ in fresh], [n for _, n in fresh])
        behind = [w for w, i in zip(members, infos) if i["applied"] != self.step]
        if behind and reason != "start" and whole is None:
            source = next((w for w, i in zip(members, infos) if i["applied"] == self.step), None)
            if source is None:
                raise JobError(f"no live worker holds step {self.step}; resume from the last checkpoint with `etrain train --resume {self.run_dir}`")
            state = source.state.remote()  # passed by reference: the object store carries it peer to peer
            self._gather_form([w.load_state.remote(state, self.step) for w in behind], "state migration", members)
        phases["migrate"] = time.perf_counter() - t
        t = time.perf_counter()
        self._gather_form([w.leave.remote() for w in members], "group exit", members)
        if whole is not None:
            loaded = time.perf_counter()
            self._gather_form([w.load_state.remote(whole, self.step) for w in members], "state migration", members)
            phases["migrate"] += time.perf_counter() - loaded
            t += time.perf_counter() - loaded
        self.generation += 1
        host, port = self._gather_form([members[0].host_store.remote()], "store start", members)[0]
        joins = [w.join.remote(rank, len(members), host, port, self.generation) for rank, w in enumerate(members)]
        self._gather_form(joins, "process group formation", members)
        phases["reform"] = time.perf_counter() - t
        self.workers = members

    def _note_members(self, members: list, infos: list[dict]) -> None:
        self.nodes |= {w: i["node"] for w, i in zip(members, infos)}
        self.pids |= {w: i["pid"] for w, i in zip(members, infos)}
        self.peaks |= {w: i["peak_flops"] for w, i in zip(members, infos)}
        self.flops_per_token = flops_per_token(self.cfg.model, infos[0]["params"])

    def _gather_form(self, refs: list, what: str, members: list) -> list:
        """A phase of a group change on every member, or MembersLost naming the ones that died.
        (A member dead during "process group formation" is found only once the others' rendezvous
        times out, at timeouts.join_s; they are then taken for hung too.)"""
        try:
            return ray.get(refs, timeout=self.cfg.timeouts.join_s)
        except ray.exceptions.GetTimeoutError:
            raise JobError(
                f"{what} did not finish within {self.cfg.timeouts.join_s:.0f} s (timeouts.join_s); a worker is hung or the cluster lacks resources"
            ) from None
        except ray.exceptions.RayActorError as e:
            if e.actor_init_failed:  # the same config would fail the same way in a replacement
                raise JobError(_could_not_start(e)) from None
            raise MembersLost(self._find_lost(what, getattr(e, "cause", e), members)) from None
        except ray.exceptions.RayTaskError as e:
            raise MembersLost(self._find_lost(what, getattr(e, "cause", e), members)) from None

    def _start_caches(self, nodes: set[str]) -> None:
        """A ShardCache on each of `nodes` that has none, fetching the shard the run reads next."""
        data = self.cfg.data
        for node in nodes - set(self.caches):
            here = NodeAffinitySchedulingStrategy(node, soft=False)
            actor = ray.remote(ShardCache).options(num_cpus=0, max_concurrency=32, scheduling_strategy=here)
            self.caches[node] = actor.remote(self.manifest, self.layout, data.cache_shards, data.node_cache_dir)
            self.caches[node].warm.remote(self.cursor)

    def _attach_caches(self, workers: list, nodes: list[str], cursor: int | None = None, wait: bool = True) -> list:
        """One ShardCache per node that runs workers; each worker reads through its node's."""
        self._start_caches(set(nodes))
        attached = [w.attach_cache.remote(self.caches[n], self.layout, cursor) for w, n in zip(workers, nodes)]
        if wait:
            self._gather(attached, "cache attach")
        self._attached |= set(workers)
        return attached

    def _restore(self) -> None:
        """Resume: the latest committed checkpoint's state, or the start when there is none."""
        started = time.perf_counter()
        ckpt = self._latest_checkpoint()
        if ckpt is not None:
            parts = ray.put(ckpt.parts)
            self._gather([w.load_state.remote(parts, ckpt.meta["step"]) for w in self.workers], "state load", self.cfg.timeouts.join_s)
        self._rewind(ckpt, "resume", load_s=time.perf_counter() - started)

    def _latest_checkpoint(self):
        return self.saver.latest(self.cfg.hash())

    def _rewind(self, ckpt, kind: str, load_s: float | None = None) -> None:
        """The cursor and step to the checkpoint's (to the start without one, as the workers are built); the
        records of the steps after it are moved aside, so whatever the run directory held, no step is recorded twice."""
        meta = ckpt.meta if ckpt is not None else {"step": 0, "cursor": 0, "level": None}
        reached = (self.saver.reached() or meta["step"]) if kind == "resume" else self.step
        self.step, self.cursor = meta["step"], meta["cursor"]
        self.saved_step = self.step
        self.saver.base = None  # the next save is a full one: a light one needs hashes of a base this run wrote
        if kind == "resume":  # a rollback keeps the lr it has halved since
            self.lr_scale = meta.get("lr_scale", 1.0)
            self.balancer.load(meta.get("balance"), self.workers)
        self.norms = NormWatch(**meta.get("norms", {}))
        base = ckpt.base if ckpt is not None else None
        if base is not None:
            log.warning(
                "%s from the light checkpoint %s: weights of step %d, optimizer, scheduler and scaler state of the "
                "full checkpoint %s (step %d); the run does not follow the uninterrupted trajectory exactly",
                kind,
                ckpt.path,
                meta["step"],
                base,
                meta["base_step"],
            )
        reason = "the latest committed checkpoint" if ckpt is not None else f"no committed checkpoint under {self.ckpt_uri}: from the start"
        moved = truncate_after(self.run_dir / "metrics.jsonl", self.step)
        self._record(
            {
                "kind": kind,
                "step": self.step,
                "path": ckpt.path if ckpt is not None else None,
                "level": meta["level"],
                "base": base,
                "reason": reason,
                "reached_step": reached,
                "records_redone": moved,
                "load_s": load_s,
                "time": time.time(),
            }
        )

    def _stop(self) -> None:
        self.keeper.stop()
        self.saver.close()
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        self.pool.close()
        self.pool.reserve(0)
        closing = [c.close.remote() for c in self.caches.values()]
        ray.wait(closing, num_returns=len(closing), timeout=10)  # best effort: remove the cached files
        for c in self.caches.values():
            ray.kill(c)
        self.caches = {}

    # -- evaluation, checkpoints, records ----------------------------------------------

    def _data_metrics(self, per_worker: list[dict]) -> dict:
        """This step's data cost: slowest worker's wait, cache hits/misses, bytes fetched by the node caches."""
        refs = {node: cache.stats.remote() for node, cache in self.caches.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=STATS_S)  # a cache still starting is counted later
        delta = {"fetched_bytes": 0, "fetched_shards": 0}
        for node, ref in refs.items():
            try:
                stats = ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:  # its node is gone: so are its workers
                del self.caches[node]
                continue
            except ray.exceptions.GetTimeoutError:  # busy: counted at a later step
                continue
            for key in delta:
                delta[key] += stats[key] - self._fetched.get(node, {}).get(key, 0)
            self._fetched[node] = stats
        return {
            "data_wait_s": max(d["wait_s"] for d in per_worker),
            "cache_hits": sum(d["hits"] for d in per_worker),
            "cache_misses": sum(d["misses"] for d in per_worker),
            **delta,
        }

    def _due(self, every: int) -> bool:
        """Every `every` steps (0: never) and always after the last step."""
        return self.step == self.cfg.train.steps or (every > 0 and self.step % every == 0)

    def _maybe_evaluate(self) -> None:
        if not self._due(self.cfg.train.eval_every) or not len(self.eval_ids):
            return
        ids = self.eval_ids
        shares = order.split(ids, [1.0] * len(self.workers)) if len(ids) >= len(self.workers) else [ids]
        results = self._gather_members([w.evaluate.remote(s) for w, s in zip(self.workers, shares)], "evaluation")
        if results is None:
            return  # this step's evaluation is lost with the worker; the next one comes after recovery
        loss = sum(r[0] for r in results) / sum(r[1] for r in results)
        self._record({"kind": "eval", "step": self.step, "eval_loss": loss, "time": time.time()})

    def _checkpoint(self) -> None:
        meta = {
            "cursor": self.cursor,
            "config_hash": self.cfg.hash(),
            "config": self.cfg.model_dump(),
            "world_size": len(self.workers),
            "lr_scale": self.lr_scale,
            "norms": self.norms.state(),
            "balance": self.balancer.state(self.workers),
        }
        started = time.perf_counter()
        if self.saver.begin(self.step, self.workers, self._sharded(), meta, self._gather_members):
            self.saved_step = self.step
        self._stall += time.perf_counter() - started

    def _gather(self, refs: list, what: str, timeout: float | None = None) -> list:
        timeout = timeout or self.cfg.timeouts.step_s
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise JobError(f"{what} did not finish within {timeout:.0f} s (timeouts); a worker is hung or the cluster lacks resources") from None
        except ray.exceptions.RayActorError as e:
            raise JobError(f"a worker died during {what}: {e}; resume with `etrain train --resume {self.run_dir}`") from None

    def _record(self, record: dict) -> None:
        if self.keeper.lost:  # another driver owns the run now: not one more line from this one
            raise JobError(self.keeper.lost)
        append_jsonl(self.run_dir / "metrics.jsonl", record)
        self.dashboard.publish(record)
        with self._lock:
            self._events.append(record)
            self.latest[record["kind"]] = record
            if record["kind"] == "train":
                self._commits.append(time.monotonic())
        if time.monotonic() >= self._status_due:
            self._write_status()

    def _write_status(self) -> None:
        """status.json, what `etrain status RUN` reads without Ray (and after the job has ended); at most once a second."""
        if self.keeper.lost:  # the run's new owner writes it
            return
        write_json(self.run_dir / "status.json", {**self.status(), "updated": time.time()})
        self._status_due = time.monotonic() + STATUS_S

    def _summary(self) -> dict:
        summary = summarize(self.run_dir / "metrics.jsonl", self.cfg, self.started_at, self.first_step_at)
        write_json(self.run_dir / "summary.json", summary)
        return summary


def _could_not_start(error: ray.exceptions.RayActorError) -> str:
    """A worker's constructor failed: its own exception, and what to do about it."""
    said = why(error)
    if any(m in said.lower() for m in ("allocate", "out of memory", "outofmemory")):
        return (
            f"a worker could not start: {said}; the model does not fit a worker's memory: lower model.d_model, "
            f"model.n_layer or train.micro_batch (`etrain config` prints the estimate), or use larger nodes"
        )
    return f"a worker could not start: {said}; fix the cause, then start the job again"


def worker_nodes(c) -> set[str]:
    """Alive nodes big enough for one worker of `c` (cluster config): where pool workers can start."""
    fits = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= c.cpus_per_worker]
    return {n["NodeID"] for n in fits if not c.gpus_per_worker or n["Resources"].get("GPU", 0) >= c.gpus_per_worker}


def draining_nodes() -> set[str]:
    """Nodes with a drain request: a preemption notice (autoscaler v2, KubeRay, `ray drain-node`)
    or an idle termination. Ray exposes it only internally (Ray Serve reads it the same way)."""
    return set(ray._private.state.state.get_draining_nodes())
