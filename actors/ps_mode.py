"""Parameter-server mode, driven for the coordinator: no step barrier, bounded staleness.

Parameter shards live in ParamShard actors spread over the nodes (actors/ps.py
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

from actors.control import JobError
from actors.ps import ParamShard, assign_shards
from pipelines import order


class PSTraining:
    def __init__(self, coord):
        self.coord = coord  # the Coordinator: config, workers, layout, cursor, records, checkpoints
        self.per_worker = coord.cfg.train.global_batch // len(coord.workers)
        self.shards: list = []
        self.pushes: list[dict] = []  # push results since the last train record
        self.faults: dict[int, dict] = {}  # rank -> injected fault due, given with that rank's next batch

    def start(self, restored: dict | None) -> None:
        """Shards spread over the nodes, filled from worker 0's parameters and optimizer moments."""
        coord, comm = self.coord, self.coord.cfg.comm
        lead = coord.workers[0]
        if restored is not None:
            coord._gather([lead.load_state.remote(restored, coord.step)], "state load")
        params, moments = coord._gather([lead.ps_export.remote()], "parameter export")[0]
        names = assign_shards({n: tuple(t.shape) for n, t in params.items()}, comm.ps_shards)
        actor = ray.remote(ParamShard).options(num_cpus=0, max_concurrency=256, scheduling_strategy="SPREAD")
        optim = coord.cfg.optim.model_dump()
        self.shards = [
            actor.remote(
                {n: params[n] for n in part},
                optim,
                coord.cfg.train.steps,
                len(coord.workers),
                comm.ps_window_s,
                comm.ps_max_staleness,
                coord.cfg.train.global_batch,
            )
            for part in names
        ]
        if restored is not None:  # the optimizer moments travel with their parameters
            loads = [
                s.load.remote(
                    {
                        "version": coord.step,
                        "samples": coord.cursor,
                        "params": {n: params[n] for n in part},
                        "optim": {n: moments[n] for n in part if n in moments},
                    }
                )
                for s, part in zip(self.shards, names)
            ]
            coord._gather(loads, "shard load")
        coord._gather([w.ps_attach.remote(self.shards, names, i) for i, w in enumerate(coord.workers)], "shard attach")

    def run(self) -> None:
        """Hand out batches until train.steps × global_batch samples are applied; evaluate and checkpoint at quiet points."""
        coord = self.coord
        if coord.cursor != coord.step * coord.cfg.train.global_batch:
            raise JobError(
                f"checkpoint at step {coord.step} has cursor {coord.cursor}, not {coord.step} global batches "
                "(it was made with train.batch_scaling=linear); parameter-server mode cannot go on from it"
            )
        while coord.step < coord.cfg.train.steps:
            self._train_until(self._next_quiet_step() * coord.cfg.train.global_batch)
            coord._gather([w.ps_pull.remote(computing=False) for w in coord.workers], "parameter pull")
            coord._maybe_evaluate()
            if coord._due(coord.cfg.checkpoint.every):
                params, moments = self.state()
                coord._gather([coord.workers[0].ps_state.remote(params, moments, coord.step)], "checkpoint")
                coord._checkpoint()
        stats = coord._gather([s.stats.remote() for s in self.shards], "shard stats")
        coord._record({"kind": "ps", "step": coord.step, "shards": stats, "time": time.time()})

    def _next_quiet_step(self) -> int:
        cfg, step = self.coord.cfg, self.coord.step
        every = [e for e in (cfg.train.eval_every, cfg.checkpoint.every) if e > 0]
        return min([cfg.train.steps, *((step // e + 1) * e for e in every)])

    def _train_until(self, until: int) -> None:
        """Keep every worker busy with the next samples in the global order until the cursor reaches `until`."""
        coord = self.coord
        dispatched, in_flight, idle = coord.cursor, {}, list(range(len(coord.workers)))
        started = time.perf_counter()
        while dispatched < until or in_flight:
            while idle and dispatched < until:
                rank = idle.pop(0)
                ids = order.take(coord.layout, dispatched, min(self.per_worker, until - dispatched))
                self.faults |= coord._faults_for(coord.step + 1)
                in_flight[coord.workers[rank].ps_step.remote(coord.step, ids, dispatched, self.faults.pop(rank, None))] = rank
                dispatched += len(ids)
            done, _ = ray.wait(list(in_flight), num_returns=1, timeout=coord.cfg.timeouts.step_s)
            if not done:
                raise JobError(f"no parameter-server push finished within timeouts.step_s={coord.cfg.timeouts.step_s}")
            idle.append(in_flight.pop(done[0]))
            result = coord._gather(done, "parameter-server step")[0]
            self.pushes.append(result)
            coord.cursor += result["samples"]
            if coord.cursor >= (coord.step + 1) * coord.cfg.train.global_batch:
                self._commit(time.perf_counter() - started)
                started = time.perf_counter()

    def _commit(self, elapsed: float) -> None:
        """One train record per global batch applied (pushes land whole: a record may hold a few samples more)."""
        coord, pushes = self.coord, self.pushes
        self.pushes = []
        samples = sum(p["samples"] for p in pushes)
        staleness = [p["staleness"] for p in pushes]
        coord.step = coord.cursor // coord.cfg.train.global_batch
        coord.first_step_at = coord.first_step_at or time.time()
        coord._record(
            {
                "kind": "train",
                "step": coord.step,
                "world_size": len(coord.workers),
                "batch": samples,
                "samples": coord.cursor,
                "loss": sum(p["loss"] * p["samples"] for p in pushes) / samples,
                "lr": pushes[-1]["lr"],
                "grad_norm": float(np.mean([p["grad_norm"] for p in pushes])),
                "step_time_s": elapsed,
                "tokens_per_s": samples * coord.cfg.model.seq_len / elapsed,
                "mfu": coord.mfu(samples * coord.cfg.model.seq_len / elapsed),
                "worker_s": max(p["worker_s"] for p in pushes),
                "shares": [p["samples"] for p in pushes],
                "pushes": len(pushes),
                "max_staleness": max(staleness),
                "mean_staleness": float(np.mean(staleness)),
                "version": max(p["version"] for p in pushes),
                "time": time.time(),
            }
        )

    def state(self) -> tuple[dict, dict]:
        """Every shard's parameters and optimizer moments, merged by name."""
        states = self.coord._gather([s.state.remote() for s in self.shards], "shard state")
        return ({n: t for st in states for n, t in st["params"].items()}, {n: m for st in states for n, m in st["optim"].items()})

    def close(self) -> None:
        for s in self.shards:
            ray.kill(s)
        self.shards = []
