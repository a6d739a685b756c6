"""Parameter-server mode, driven for the coordinator: no step barrier, bounded staleness.

Parameter shards live in ParamShard actors spread over the nodes (etrain/control/ps.py
holds the update rule). Each worker goes at its own pace: pull the parameters,
compute the gradient of its next `global_batch / num_workers` samples, push it,
and wait only for the update that includes it. A slow worker slows only itself:
its gradient is folded into a later update (its staleness is bounded by
`comm.ps_max_staleness` and recorded) while the others go on.

A step here is `train.global_batch` samples applied, so steps, the cursor and
the records mean what they mean in all-reduce mode. Samples are handed out in
the global order as workers ask for them; evaluations and checkpoints happen at
quiet points (nothing in flight), so a checkpoint's cursor counts exactly the
samples whose gradients are in its parameters. Runs are not bit-reproducible:
which update a gradient lands in depends on timing.
"""

from __future__ import annotations

import time

import numpy as np
import ray

from etrain.control.control import JobError, due
from etrain.control.gather import WorkersLost
from etrain.control.ps import ParamShard, assign_shards
from etrain.control.step import Stepper
from etrain.core.records import PSSummary, Train
from etrain.data import order


class PSTraining(Stepper):
    """The stepper of the one mode that does not go through the coordinator's state machine (its spec's own_loop):
    with no process group and no step barrier there is no step boundary to decide at. Workers push as they finish,
    the shards count steps, evaluations and checkpoints come at those counts, and a lost worker ends the job (it
    cannot recover, or be resized)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.per_worker = self.cfg.train.global_batch // self.cfg.cluster.num_workers
        self.shards: list = []
        self.pushes: list[dict] = []  # push results since the last train record
        self.due: dict[int, dict] = {}  # rank -> injected fault due, given with that rank's next batch

    def drive(self, coordinator, resume: bool) -> None:
        """The run from its start (or its checkpoint) to its end, for the coordinator: its position, the wait that
        fails the job on a lost member, its evaluation and checkpoint, each at a quiet point."""
        self.coordinator, self.at, self.gather = coordinator, coordinator.at, coordinator.gather_all
        try:
            self.team.start_ps(self.at)
        except WorkersLost as gone:
            raise JobError(f"{gone}; {coordinator.hint}") from None
        point = coordinator.resume_point() if resume else None
        try:
            self.start(point.ckpt.parts if point is not None and point.ckpt is not None else None)
            self.run()
        finally:
            self.close()

    def start(self, restored: dict | None) -> None:
        """Shards spread over the nodes, filled from worker 0's parameters and optimizer moments."""
        cfg, comm, at, workers = self.cfg, self.cfg.comm, self.at, self.team.workers
        lead = workers[0]
        if restored is not None:
            self.gather([lead.load_state.remote(restored, at.step)], "state load")
        params, moments = self.gather([lead.call.remote("export")], "parameter export")[0]
        names = assign_shards({n: tuple(t.shape) for n, t in params.items()}, comm.ps_shards)
        actor = ray.remote(ParamShard).options(num_cpus=0, max_concurrency=256, scheduling_strategy="SPREAD")
        optim = cfg.optim.model_dump()
        self.shards = [
            actor.remote(
                {n: params[n] for n in part},
                optim,
                cfg.train.steps,
                len(workers),
                comm.ps_window_s,
                comm.ps_max_staleness,
                cfg.train.global_batch,
            )
            for part in names
        ]
        if restored is not None:  # the optimizer moments travel with their parameters
            parts = [
                {
                    "version": at.step,
                    "samples": at.cursor,
                    "params": {n: params[n] for n in part},
                    "optim": {n: moments[n] for n in part if n in moments},
                }
                for part in names
            ]
            self.gather([s.load.remote(part) for s, part in zip(self.shards, parts)], "shard load")
        self.gather([w.call.remote("attach", self.shards, names, i) for i, w in enumerate(workers)], "shard attach")

    def run(self) -> None:
        """Hand out batches until train.steps × global_batch samples are applied; evaluate and checkpoint at quiet
        points."""
        cfg, at = self.cfg, self.at
        if at.cursor != at.step * cfg.train.global_batch:
            raise JobError(
                f"checkpoint at step {at.step} has cursor {at.cursor}, not {at.step} global batches "
                "(it was made with train.batch_scaling=linear); parameter-server mode cannot go on from it"
            )
        while at.step < cfg.train.steps:
            self._train_until(self._next_quiet_step() * cfg.train.global_batch)
            self.gather([w.call.remote("pull", computing=False) for w in self.team.workers], "parameter pull")
            if due(at.step, cfg.train.eval_every, cfg.train.steps):
                self._quietly(self.coordinator.evaluate, "an evaluation")
            if due(at.step, cfg.checkpoint.every, cfg.train.steps):
                params, moments = self.shard_state()
                self.gather([self.team.workers[0].call.remote("take_state", params, moments, at.step)], "checkpoint")
                self._quietly(self.coordinator.checkpoint, "a checkpoint")
        self.log.record(PSSummary(at.step, self.gather([s.stats.remote() for s in self.shards], "shard stats")))

    def _quietly(self, act, what: str) -> None:
        """An evaluation or a checkpoint at a quiet point; a member lost in it ends the job (no recovery here)."""
        if act() is not None:
            raise JobError(
                f"a worker was lost during {what}, and parameter-server mode cannot recover; {self.coordinator.hint}"
            )

    def _next_quiet_step(self) -> int:
        cfg, step = self.cfg, self.at.step
        every = [e for e in (cfg.train.eval_every, cfg.checkpoint.every) if e > 0]
        return min([cfg.train.steps, *((step // e + 1) * e for e in every)])

    def _train_until(self, until: int) -> None:
        """Keep every worker busy with the next samples in the global order until the cursor reaches `until`."""
        at, workers, step_s = self.at, self.team.workers, self.cfg.timeouts.step_s
        dispatched, in_flight, idle = at.cursor, {}, list(range(len(workers)))
        started = time.perf_counter()
        while dispatched < until or in_flight:
            while idle and dispatched < until:
                rank = idle.pop(0)
                ids = order.take(self.data.layout, dispatched, min(self.per_worker, until - dispatched))
                self.due |= self.faults.due(at.step + 1)
                in_flight[
                    workers[rank].step.remote(at.step + 1, {"ids": ids, "cursor": dispatched}, self.due.pop(rank, None))
                ] = rank
                dispatched += len(ids)
            done, _ = ray.wait(list(in_flight), num_returns=1, timeout=step_s)
            if not done:
                raise JobError(f"no parameter-server push finished within timeouts.step_s={step_s}")
            idle.append(in_flight.pop(done[0]))
            result = self.gather(done, "parameter-server step")[0]
            self.pushes.append(result)
            at.cursor += result["samples"]
            if at.cursor >= (at.step + 1) * self.cfg.train.global_batch:
                self._commit(time.perf_counter() - started)
                started = time.perf_counter()

    def _commit(self, elapsed: float) -> None:
        """One train record per global batch applied (pushes land whole: a record may hold a few samples more)."""
        pushes, at = self.pushes, self.at
        self.pushes = []
        samples = sum(p["samples"] for p in pushes)
        staleness = [p["staleness"] for p in pushes]
        at.step = at.cursor // self.cfg.train.global_batch
        tokens_per_s = samples * self.cfg.model.seq_len / elapsed
        record = Train(at.step, len(self.team.workers), samples, at.cursor)
        record.loss = sum(p["loss"] * p["samples"] for p in pushes) / samples
        record.lr, record.grad_norm = pushes[-1]["lr"], float(np.mean([p["grad_norm"] for p in pushes]))
        record.step_time_s, record.tokens_per_s, record.mfu = (
            elapsed,
            tokens_per_s,
            self.team.mfu(tokens_per_s, at.step),
        )
        record.worker_s, record.shares = max(p["worker_s"] for p in pushes), [p["samples"] for p in pushes]
        record.extra = {
            "pushes": len(pushes),
            "max_staleness": max(staleness),
            "mean_staleness": float(np.mean(staleness)),
            "version": max(p["version"] for p in pushes),
        }
        self.log.record(record)

    def shard_state(self) -> tuple[dict, dict]:
        """Every shard's parameters and optimizer moments, merged by name."""
        states = self.gather([s.state.remote() for s in self.shards], "shard state")
        return (
            {n: t for st in states for n, t in st["params"].items()},
            {n: m for st in states for n, m in st["optim"].items()},
        )

    def close(self) -> None:
        for s in self.shards:
            ray.kill(s)
        self.shards = []
