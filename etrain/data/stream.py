"""Training samples by global id, streamed through the node's shard cache.

A worker keeps the shards its current step reads (pinned in the node cache
under its `holder` name, memory-mapped here) and lets go of the rest, so the
cache can evict them.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow.parquet as pq
import ray

from etrain.data import order
from etrain.data.shards import decode, read_manifest


class StreamingReader:
    def __init__(self, manifest_uri: str, layout: order.Layout, cache, holder: str):
        manifest = read_manifest(manifest_uri)
        self.row_len = manifest["seq_len"] + 1
        self.dtype = np.dtype(manifest["token_dtype"])
        self.layout = layout
        self.cache, self.holder = cache, holder
        self.views: dict[int, np.ndarray] = {}

    def get(self, ids: np.ndarray, cursor: int) -> tuple[np.ndarray, dict]:
        """Rows for `ids` (in order), and what it cost: cache hits, misses, seconds waited."""
        started = time.perf_counter()
        shards = self.layout.shard_of(ids)
        needed = {int(s) for s in np.unique(shards)}
        stats = {"hits": 0, "misses": 0}
        for shard in sorted(needed - set(self.views)):
            got = ray.get(self.cache.acquire.remote(shard, cursor, self.holder))
            stats["hits" if got["hit"] else "misses"] += 1
            # ParquetFile, not read_table: read_table imports pyarrow.dataset (~0.3 s), on a joiner's first step.
            table = pq.ParquetFile(got["path"], memory_map=True).read(columns=["tokens"])
            self.views[shard] = decode(table, self.row_len, self.dtype)
        for shard in set(self.views) - needed:
            del self.views[shard]
            self.cache.release.remote(shard, self.holder)
        out = np.empty((len(ids), self.row_len), dtype=self.dtype)
        for shard in needed:
            mask = shards == shard
            out[mask] = self.views[shard][ids[mask] - self.layout.starts[shard]]
        stats["wait_s"] = time.perf_counter() - started
        return out, stats

    def close(self) -> None:
        for shard in self.views:
            self.cache.release.remote(shard, self.holder)
        self.views.clear()
