"""Per-node shard cache: at most `capacity` shards on local disk, shared by the node's workers.

Written by hand because no library has it: MosaicML Streaming's cache is LRU,
needs >= 4 shards and re-downloads every epoch. Ours knows the future, since
the sample order (etrain.data.order) is a pure function of the seed: it pins the
shards being read, prefetches the next shard of the order while the current
ones are read, and evicts the unpinned shard needed furthest ahead (Belady).
One Ray actor per node owns the decisions, so workers in other processes never
race; they read the files it hands out. If every slot is pinned, a request
overflows the capacity by one rather than deadlocking, and says so in stats.

A pin belongs to its holder (a worker's actor id), so the pins of a worker that
was killed or lost can be released for it (`release_holder`): a dead reader must
not keep shards from eviction for the rest of the run. A cache directory is
named after its process; the directories of dead processes (a coordinator killed,
a Ctrl-C) are removed when the next cache of the node starts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import fsspec

from etrain.core.lease import pid_alive
from etrain.core.storage import STORAGE_ERRORS, describe
from etrain.data import order
from etrain.data.shards import ShardError, read_manifest

logger = logging.getLogger(__name__)

# transient download errors (an object store's brief outage), with exponential backoff from 0.5 s: 7.5 s in all
RETRIES = 5


class ShardCache:
    def __init__(self, manifest_uri: str, layout: order.Layout, capacity: int, cache_dir: str):
        manifest = read_manifest(manifest_uri)
        self.root = posixpath.dirname(manifest_uri)
        self.shards = manifest["splits"]["train"]["shards"]
        self.layout = layout
        self.capacity = capacity
        key = hashlib.sha256(manifest_uri.encode()).hexdigest()[:12]
        self.dir = Path(cache_dir).expanduser() / f"{key}-{os.getpid()}"
        remove_orphans(self.dir.parent)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._present: dict[int, Future] = {}  # shard -> download (done or in flight)
        self._pins: dict[int, Counter] = {}  # shard -> its holders and their pin counts
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="shard-fetch")
        self.stats_ = {
            "hits": 0,
            "misses": 0,
            "fetched_shards": 0,
            "fetched_bytes": 0,
            "evicted": 0,
            "overflows": 0,
            "retries": 0,
        }

    def acquire(self, shard: int, cursor: int, holder: str) -> dict:
        """Pin `shard` for `holder`, wait until it is on local disk, and prefetch what comes next after `cursor`."""
        started = time.perf_counter()
        with self._lock:
            hit = shard in self._present  # cached, or prefetched and still arriving (the wait is timed apart)
            self.stats_["hits" if hit else "misses"] += 1
            self._pins.setdefault(shard, Counter())[holder] += 1
            future = self._ensure(shard, cursor)
            self._prefetch(cursor)
        try:
            path = future.result()
        except Exception:
            self.release(shard, holder)
            with self._lock:
                self._present.pop(shard, None)
            raise
        return {"path": path, "hit": hit, "wait_s": time.perf_counter() - started}

    def warm(self, cursor: int) -> None:
        """Start fetching the shard read at `cursor` (a new node's cache, before its first worker asks)."""
        with self._lock:
            self._prefetch(cursor)

    def release(self, shard: int, holder: str) -> None:
        with self._lock:
            holders = self._pins.get(shard, Counter())
            holders[holder] -= 1
            if holders[holder] <= 0:
                del holders[holder]
            if not holders:
                self._pins.pop(shard, None)

    def release_holder(self, holder: str) -> None:
        """Every pin of a reader that is gone (killed, lost with its node) or was stopped."""
        with self._lock:
            for shard in list(self._pins):
                self._pins[shard].pop(holder, None)
                if not self._pins[shard]:
                    del self._pins[shard]

    def stats(self) -> dict:
        with self._lock:
            return {**self.stats_, "cached": sorted(self._present), "pinned": sorted(self._pins)}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- decisions, under the lock ------------------------------------------

    def _ensure(self, shard: int, cursor: int) -> Future:
        if shard not in self._present:
            if len(self._present) >= self.capacity and not self._evict_for(shard, cursor):
                self.stats_["overflows"] += 1
                logger.warning(
                    "shard cache full of pinned shards; holding %d over capacity %d",
                    len(self._present) + 1,
                    self.capacity,
                )
            self._present[shard] = self._pool.submit(self._download, shard)
        return self._present[shard]

    def _prefetch(self, cursor: int) -> None:
        """Start fetching the next shard of the order that is not here, if a slot is free or can be freed."""
        for shard in order.shards_ahead(self.layout, cursor, horizon=len(self.layout.sizes)):
            if shard in self._present:
                continue
            if len(self._present) < self.capacity or self._evict_for(shard, cursor):
                self._present[shard] = self._pool.submit(self._download, shard)
            return  # one at a time; the next acquire looks again

    def _evict_for(self, wanted: int, cursor: int) -> bool:
        """Free a slot for `wanted` if an unpinned shard is needed later than it (or never soon)."""
        ahead = order.shards_ahead(self.layout, cursor, horizon=len(self.layout.sizes))
        rank = {s: i for i, s in enumerate(ahead)}
        far = len(ahead)
        candidates = [s for s, f in self._present.items() if s not in self._pins and f.done()]
        if not candidates:
            return False
        victim = max(candidates, key=lambda s: rank.get(s, far))
        if rank.get(victim, far) <= rank.get(wanted, far):
            return False
        del self._present[victim]
        (self.dir / self._name(victim)).unlink(missing_ok=True)
        self.stats_["evicted"] += 1
        return True

    # -- transfers, in the pool ---------------------------------------------

    def _download(self, shard: int) -> str:
        entry = self.shards[shard]
        target = self.dir / self._name(shard)
        for attempt in range(2):  # a corrupt copy is fetched once more, then it is an error
            data = self._fetch(posixpath.join(self.root, entry["path"]))
            if hashlib.sha256(data).hexdigest() == entry["sha256"]:
                tmp = target.with_suffix(".part")
                tmp.write_bytes(data)
                os.replace(tmp, target)
                with self._lock:
                    self.stats_["fetched_shards"] += 1
                    self.stats_["fetched_bytes"] += len(data)
                return str(target)
            logger.warning("shard %s failed its sha256 check (attempt %d)", entry["path"], attempt + 1)
        raise ShardError(
            f"shard {posixpath.join(self.root, entry['path'])} does not match its manifest sha256 after a re-fetch; "
            "it is corrupt at the source: re-run `etrain prepare`"
        )

    def _fetch(self, uri: str) -> bytes:
        for attempt in range(RETRIES):
            try:
                with fsspec.open(uri, "rb") as f:
                    return f.read()
            except FileNotFoundError:
                raise ShardError(f"shard {uri} listed in the manifest is missing") from None
            except STORAGE_ERRORS as e:
                if attempt == RETRIES - 1:
                    raise ShardError(f"shard {uri} could not be fetched after {RETRIES} tries: {describe(e)}") from None
                logger.warning("fetching shard %s failed (%s); retrying in %.1f s", uri, describe(e), 0.5 * 2**attempt)
                with self._lock:
                    self.stats_["retries"] += 1
                time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    @staticmethod
    def _name(shard: int) -> str:
        return f"{shard:06d}.parquet"


def remove_orphans(parent: Path) -> None:
    """Remove the cache directories (`KEY-PID`) of processes that are gone."""
    if not parent.is_dir():
        return
    for d in parent.iterdir():
        named = re.fullmatch(r"[0-9a-f]{12}-(\d+)", d.name)
        if named and d.is_dir() and not pid_alive(int(named.group(1))):
            shutil.rmtree(d, ignore_errors=True)
