"""The run's data, as the coordinator sees it: the sample layout, the held-out ids, one shard cache per node,
what each step's data cost, and the quarantine log of the samples an outlier step skipped.

A node's cache starts as soon as the node can host a worker, and fetches the shard the run reads
next, so a worker starting there finds it on local disk. A worker's pins in its node's cache are
released for it when it is stopped: a killed reader cannot release them itself.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from etrain.control.gather import values_of
from etrain.core.config import Config
from etrain.core.records import append_jsonl
from etrain.data import order
from etrain.data.cache import ShardCache
from etrain.data.shards import read_manifest, row_sources

CACHE = ray.remote(ShardCache)  # one class, exported once (relay.py's REMOTE)
STATS_S = 0.05  # how long a step waits for the node caches' counts: a cache still starting is counted later
ATTACH_S = 0.2  # how long the loop waits for a warm pool worker's cache attach (most take ~50 ms)


def _answers(refs: list) -> dict:
    """The values of `refs`, all back, in one get (a get per cache cost 34 ms of a step at 1,024 workers on 128
    nodes, bench/scale.py); a dead cache's as None."""
    values, dead = values_of(refs)
    return values | dict.fromkeys(dead)


class DataPlane:
    def __init__(self, cfg: Config, manifest: str, run_dir: Path):
        self.cfg, self.manifest, self.run_dir = cfg, manifest, run_dir
        self.caches: dict[str, object] = {}  # node id -> its ShardCache actor
        self.attached: set = set()  # workers reading through their node's cache
        self._fetched: dict[str, dict] = {}  # node -> its cache's last counts (what it had fetched)

    def open(self) -> None:
        """Read the manifest: the layout of the training samples, the held-out ids."""
        cfg, splits = self.cfg, read_manifest(self.manifest)["splits"]
        self.shard_paths = [s["path"] for s in splits["train"]["shards"]]  # to name a quarantined sample's source
        self.layout = order.Layout(
            cfg.train.seed, tuple(s["samples"] for s in splits["train"]["shards"]), cfg.data.shuffle_shards
        )
        # A fixed held-out subset (seed 0, not the training seed) so runs and trials compare.
        num_eval = splits["eval"]["samples"]
        self.eval_ids = order.take(order.Layout(0, (num_eval,), 1), 0, min(cfg.train.eval_samples, num_eval))

    def start_caches(self, nodes: set[str], cursor: int) -> None:
        """A ShardCache on each of `nodes` that has none, fetching the shard the run reads at `cursor`."""
        data = self.cfg.data
        for node in nodes - set(self.caches):
            here = NodeAffinitySchedulingStrategy(node, soft=False)
            actor = CACHE.options(num_cpus=0, max_concurrency=32, scheduling_strategy=here)
            self.caches[node] = actor.remote(self.manifest, self.layout, data.cache_shards, data.node_cache_dir)
            self.caches[node].warm.remote(cursor)

    def attach(self, workers: list, nodes: list[str], cursor: int, read: bool = False) -> list:
        """Each worker reads through its node's cache (refs of the attach calls); with `read`, it opens the
        shard read at `cursor` now (a pool worker, so that its first step does not pay for it)."""
        self.start_caches(set(nodes), cursor)
        self.attached |= set(workers)
        return [
            w.attach_cache.remote(self.caches[n], self.layout, cursor if read else None) for w, n in zip(workers, nodes)
        ]

    def release(self, worker, node: str | None = None) -> None:
        """Every pin of a worker that was stopped: in its `node`'s cache, the only one it reads through; in every
        cache where its node is not known (a call per node for each worker lost: 128 calls each at 1,024 workers).
        A reader's holder name is its actor id (no public accessor)."""
        self.attached.discard(worker)
        for cache in [self.caches[node]] if node in self.caches else self.caches.values():
            cache.release_holder.remote(worker._actor_id.hex())

    def cost(self, per_worker: list[dict]) -> dict:
        """This step's data cost: the slowest worker's wait, cache hits and misses, what the node caches fetched (a
        relayed step brings its nodes' counts in its reports, `data["cache"]`: relay.py; the other caches are asked
        here)."""
        relayed = {c["node"]: c for d in per_worker if (c := d.get("cache"))}
        refs = {node: cache.stats.remote() for node, cache in self.caches.items() if node not in relayed}
        done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=STATS_S) if refs else ([], [])
        answers = _answers(done)
        counts = {node: answers[ref] for node, ref in refs.items() if ref in answers}  # a busy one: counted later
        counts |= {node: None if c.get("gone") else c for node, c in relayed.items()}
        fetched = {"fetched_bytes": 0, "fetched_shards": 0}
        for node, stats in counts.items():
            if stats is None:  # its node is gone: so are its workers (a cache started there again counts from 0)
                self.caches.pop(node, None)
                self._fetched.pop(node, None)
                continue
            for key in fetched:
                fetched[key] += stats[key] - self._fetched.get(node, {}).get(key, 0)
            self._fetched[node] = stats
        return {
            "data_wait_s": max(d["wait_s"] for d in per_worker),
            "cache_hits": sum(d["hits"] for d in per_worker),
            "cache_misses": sum(d["misses"] for d in per_worker),
            **fetched,
        }

    def quarantine(self, step: int, ids: np.ndarray, grad_norm: float, limit: float) -> None:
        """An outlier step's samples, with the shard and row each came from and the documents it was packed
        from (the shard's `sources` column), to the run's quarantine log."""
        shards = self.layout.shard_of(ids)
        rows = ids - self.layout.starts[shards]
        sources = [
            {"sample": int(i), "shard": self.shard_paths[s], "row": int(r)} for i, s, r in zip(ids, shards, rows)
        ]
        for s in np.unique(shards):
            mine = np.flatnonzero(shards == s)
            docs = row_sources(posixpath.join(posixpath.dirname(self.manifest), self.shard_paths[s]), rows[mine])
            for k, names in zip(mine, docs or []):
                sources[k]["documents"] = names
        append_jsonl(
            self.run_dir / "quarantine.jsonl",
            {"step": step, "grad_norm": grad_norm, "limit": limit, "sources": sources},
        )

    def close(self, wait_s: float) -> None:
        """Stop the caches, best effort: their files are removed if they answer within `wait_s`."""
        closing = [c.close.remote() for c in self.caches.values()]
        ray.wait(closing, num_returns=len(closing), timeout=wait_s)
        for c in self.caches.values():
            ray.kill(c)
        self.caches = {}
