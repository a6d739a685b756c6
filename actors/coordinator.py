"""Coordinator: drives the workers and owns the global cursor, the step loop and the run's records.

It runs as a Ray actor pinned to the driver's node (the run directory lives
there). It never imports torch, so it starts in about a second while the
workers (created by the driver, see `actors.worker.spawn`) import torch and
build their models; checkpoint state reaches it as bytes. The driver only
starts it and polls it for progress.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from app import checkpoint
from app.config import Config
from app.metrics import append_jsonl, truncate_after, write_json
from app.report import summarize
from pipelines import order
from pipelines.cache import ShardCache
from pipelines.shards import read_manifest

log = logging.getLogger(__name__)


class Phase(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    EVALUATING = "evaluating"
    CHECKPOINTING = "checkpointing"
    FINISHED = "finished"
    FAILED = "failed"


class JobError(RuntimeError):
    """Training cannot go on; the message says why and what to do."""


class Coordinator:
    def __init__(self, cfg_dict: dict, run_dir: str, manifest: str, started_at: float, workers: list):
        self.cfg = Config.model_validate(cfg_dict)
        self.run_dir = Path(run_dir)
        self.started_at = started_at
        self.ckpt_uri = self.cfg.checkpoint.uri or str(self.run_dir / "checkpoints")
        splits = read_manifest(manifest)["splits"]
        sizes = tuple(s["samples"] for s in splits["train"]["shards"])
        self.layout = order.Layout(self.cfg.train.seed, sizes, self.cfg.data.shuffle_shards)
        # A fixed held-out subset (seed 0, not the training seed) so runs and trials compare.
        num_eval = splits["eval"]["samples"]
        self.eval_ids = order.take(order.Layout(0, (num_eval,), 1), 0, min(self.cfg.train.eval_samples, num_eval))
        self.manifest = manifest
        self.caches: dict[str, object] = {}  # node id -> ShardCache actor
        self._fetched = {"fetched_bytes": 0, "fetched_shards": 0}
        self.step = self.cursor = 0
        self.generation = 0
        self.workers = workers
        self.phase = Phase.STARTING
        self._lock = threading.Lock()
        self._events: list[dict] = []

    # -- driver-facing ------------------------------------------------------

    def run(self, resume: bool) -> dict:
        try:
            self._form_group()
            if resume:
                self._restore()
            first_step_at = None
            while self.step < self.cfg.train.steps:
                self._train_step()
                first_step_at = first_step_at or time.time()
                self._maybe_evaluate()
                self._maybe_checkpoint()
            summary = self._summary(first_step_at)
            self.phase = Phase.FINISHED
            return summary
        except Exception:
            self.phase = Phase.FAILED
            raise
        finally:
            self._stop_workers()

    def poll(self) -> tuple[str, list[dict]]:
        """Phase and the records produced since the last poll."""
        with self._lock:
            events, self._events = self._events, []
        return self.phase.value, events

    # -- the loop -----------------------------------------------------------

    def _train_step(self) -> None:
        """Take the next global batch, split it over the workers, commit when all finished."""
        cfg = self.cfg.train
        started = time.perf_counter()
        shares = order.plan_step(self.layout, self.cursor, cfg.global_batch, [1.0] * len(self.workers))
        steps = [w.train_step.remote(self.step, s, cfg.global_batch, self.cursor) for w, s in zip(self.workers, shares)]
        results = self._gather(steps, "train step")
        elapsed = time.perf_counter() - started
        self.step += 1
        self.cursor += cfg.global_batch
        tokens = cfg.global_batch * self.cfg.model.seq_len
        self._record({
            "kind": "train", "step": self.step, "loss": sum(r["loss"] for r in results), "lr": results[0]["lr"],
            "grad_norm": results[0]["grad_norm"], "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
            "worker_s": max(r["compute_s"] for r in results), "world_size": len(self.workers),
            "samples": self.cursor, "time": time.time(), **self._data_metrics([r["data"] for r in results]),
        })

    def _data_metrics(self, per_worker: list[dict]) -> dict:
        """This step's data cost: slowest worker's wait, cache hits/misses, bytes fetched by the node caches."""
        totals = {"fetched_bytes": 0, "fetched_shards": 0}
        for stats in self._gather([c.stats.remote() for c in self.caches.values()], "cache stats"):
            for key in totals:
                totals[key] += stats[key]
        delta = {key: totals[key] - self._fetched[key] for key in totals}
        self._fetched = totals
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
        self.phase = Phase.EVALUATING
        ids = self.eval_ids
        shares = order.split(ids, [1.0] * len(self.workers)) if len(ids) >= len(self.workers) else [ids]
        results = self._gather([w.evaluate.remote(s) for w, s in zip(self.workers, shares)], "evaluation")
        loss = sum(r[0] for r in results) / sum(r[1] for r in results)
        self._record({"kind": "eval", "step": self.step, "eval_loss": loss, "time": time.time()})
        self.phase = Phase.RUNNING

    def _maybe_checkpoint(self) -> None:
        if not self._due(self.cfg.checkpoint.every):
            return
        self.phase = Phase.CHECKPOINTING
        started = time.perf_counter()
        state = self._gather([self.workers[0].state.remote()], "checkpoint")[0]
        meta = {"cursor": self.cursor, "config_hash": self.cfg.hash(), "config": self.cfg.model_dump(), "world_size": len(self.workers)}
        path = checkpoint.save(self.ckpt_uri, self.step, state, meta, self.cfg.checkpoint.keep)
        self._record({"kind": "checkpoint", "step": self.step, "path": path, "save_s": time.perf_counter() - started, "time": time.time()})
        self.phase = Phase.RUNNING

    # -- membership ---------------------------------------------------------

    def _form_group(self) -> None:
        infos = self._gather([w.info.remote() for w in self.workers], "worker start", self.cfg.timeouts.join_s)
        self._attach_caches([info["node"] for info in infos])
        self.generation += 1
        host, port = self._gather([self.workers[0].host_store.remote()], "store start")[0]
        world = len(self.workers)
        joins = [w.join.remote(rank, world, host, port, self.generation) for rank, w in enumerate(self.workers)]
        self._gather(joins, "process group formation", self.cfg.timeouts.join_s)
        self.phase = Phase.RUNNING

    def _attach_caches(self, nodes: list[str]) -> None:
        """One ShardCache per node that runs workers; each worker reads through its node's."""
        data = self.cfg.data
        for node in set(nodes) - set(self.caches):
            here = NodeAffinitySchedulingStrategy(node, soft=False)
            actor = ray.remote(ShardCache).options(num_cpus=0, max_concurrency=32, scheduling_strategy=here)
            self.caches[node] = actor.remote(self.manifest, self.layout, data.cache_shards, data.node_cache_dir)
        self._gather([w.attach_cache.remote(self.caches[n], self.layout) for w, n in zip(self.workers, nodes)], "cache attach")

    def _restore(self) -> None:
        ckpt = checkpoint.load_latest(self.ckpt_uri)
        if ckpt is None:
            log.warning("no committed checkpoint under %s: starting from step 0", self.ckpt_uri)
            return
        if ckpt.meta["config_hash"] != self.cfg.hash():
            raise JobError(f"checkpoint {ckpt.path} was made by a different model/data/optimizer config; resume with the run's own config")
        state = ray.put(ckpt.state)
        self._gather([w.load_state.remote(state) for w in self.workers], "state load", self.cfg.timeouts.join_s)
        self.step, self.cursor = ckpt.meta["step"], ckpt.meta["cursor"]
        moved = truncate_after(self.run_dir / "metrics.jsonl", self.step)
        self._record({"kind": "resume", "step": self.step, "path": ckpt.path, "records_redone": moved, "time": time.time()})

    def _stop_workers(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        closing = [c.close.remote() for c in self.caches.values()]
        ray.wait(closing, num_returns=len(closing), timeout=10)  # best effort: remove the cached files
        for c in self.caches.values():
            ray.kill(c)
        self.caches = {}

    # -- helpers ------------------------------------------------------------

    def _gather(self, refs: list, what: str, timeout: float | None = None) -> list:
        timeout = timeout or self.cfg.timeouts.step_s
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise JobError(f"{what} did not finish within {timeout:.0f} s (timeouts); a worker is hung or the cluster lacks resources") from None
        except ray.exceptions.RayActorError as e:
            raise JobError(f"a worker died during {what}: {e}; resume with `etrain train --resume {self.run_dir}`") from None

    def _record(self, record: dict) -> None:
        append_jsonl(self.run_dir / "metrics.jsonl", record)
        with self._lock:
            self._events.append(record)

    def _summary(self, first_step_at: float | None) -> dict:
        summary = summarize(self.run_dir / "metrics.jsonl", self.cfg, self.started_at, first_step_at)
        write_json(self.run_dir / "summary.json", summary)
        return summary

