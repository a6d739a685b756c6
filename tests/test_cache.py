"""The per-node shard cache on a real local Ray: capacity, Belady eviction, prefetch, integrity."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import ray

from etrain.control.data_plane import _answers
from etrain.data import order
from etrain.data.cache import ShardCache
from etrain.data.embedded import ensure_corpus
from etrain.data.shards import ShardError, ShardReader, read_manifest
from etrain.data.stream import StreamingReader

from helpers.runs import wait_until

ray_test = pytest.mark.usefixtures("ray_session")


@pytest.fixture
def corpus(make_cfg) -> str:
    return ensure_corpus(make_cfg())


def start_cache(manifest: str, tmp_path: Path, capacity: int = 3, block: int = 1, seed: int = 0):
    sizes = tuple(s["samples"] for s in read_manifest(manifest)["splits"]["train"]["shards"])
    layout = order.Layout(seed, sizes, block)
    cache = (
        ray.remote(ShardCache)
        .options(num_cpus=0, max_concurrency=8)
        .remote(manifest, layout, capacity, str(tmp_path / "cache"))
    )
    return cache, layout


def consume(reader: StreamingReader, layout: order.Layout, epochs: int, batch: int) -> list[dict]:
    stats = []
    for cursor in range(0, epochs * layout.num_samples, batch):
        ids = order.take(layout, cursor, batch)
        rows, s = reader.get(ids, cursor)
        stats.append(s)
    return stats


@ray_test
def test_streams_exact_rows_within_capacity_with_high_hit_rate(corpus, tmp_path):
    cache, layout = start_cache(corpus, tmp_path)
    assert len(layout.sizes) >= 5, "the test needs more shards than cache slots"
    reader = StreamingReader(corpus, layout, cache, holder="reader")
    direct = ShardReader(corpus, "train", cache_shards=len(layout.sizes))
    peak = 0
    for cursor in range(0, 2 * layout.num_samples, 64):
        ids = order.take(layout, cursor, 64)
        rows, _ = reader.get(ids, cursor)
        assert np.array_equal(rows, direct.get(ids))
        peak = max(peak, len(ray.get(cache.stats.remote())["cached"]))
    stats = ray.get(cache.stats.remote())
    assert peak <= 3 and stats["overflows"] == 0
    # Each shard is fetched once an epoch at most: no LRU re-download churn within an epoch.
    assert stats["fetched_shards"] <= 2 * len(layout.sizes)
    hit_rate = stats["hits"] / (stats["hits"] + stats["misses"])
    assert hit_rate >= 0.8, stats  # only the very first shard, and a tight race at block ends, may miss


@ray_test
def test_workers_of_a_node_share_one_copy(corpus, tmp_path):
    cache, layout = start_cache(corpus, tmp_path)

    @ray.remote(num_cpus=0)
    def read(cursor_range, holder):
        reader = StreamingReader(corpus, layout, cache, holder)
        for cursor in cursor_range:
            reader.get(order.take(layout, cursor, 32), cursor)
        reader.close()

    span = range(0, layout.sizes[0] * 2, 32)
    ray.get([read.remote(span, "a"), read.remote(span, "b")])
    stats = ray.get(cache.stats.remote())
    assert stats["fetched_shards"] == len(stats["cached"]) + stats["evicted"]  # each shard fetched once, not per reader
    assert stats["hits"] >= 2  # the second reader found what the first had fetched
    # A reader's close releases its pins without waiting (fire and forget): they arrive from its process, in time.
    wait_until("the readers' pins released", lambda: ray.get(cache.stats.remote())["pinned"] == [], timeout=30)


@ray_test
def test_pinned_shards_are_never_evicted_and_overflow_does_not_deadlock(corpus, tmp_path):
    cache, layout = start_cache(corpus, tmp_path, capacity=2)
    first = [ray.get(cache.acquire.remote(s, 0, "test")) for s in (0, 1, 2)]  # three pins in two slots
    assert all(Path(f["path"]).exists() for f in first)
    stats = ray.get(cache.stats.remote())
    assert stats["overflows"] >= 1 and {0, 1, 2} <= set(stats["cached"])


@ray_test
def test_corrupt_source_is_refetched_once_then_named(corpus, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(Path(corpus).parent, copy)
    entry = read_manifest(corpus)["splits"]["train"]["shards"][2]
    target = copy / entry["path"]
    target.write_bytes(target.read_bytes()[:-5] + b"xxxxx")
    cache, _ = start_cache(str(copy / "manifest.json"), tmp_path)
    with pytest.raises(ShardError, match=entry["path"]):
        ray.get(cache.acquire.remote(2, 0, "test"))
    assert ray.get(cache.stats.remote())["pinned"] == []
    assert Path(ray.get(cache.acquire.remote(0, 0, "test"))["path"]).exists()  # other shards still serve


@ray_test
def test_pins_of_a_reader_that_is_gone_are_released_for_it(corpus, tmp_path):
    """Issue 15, defect 10: a killed worker cannot release its pins; the coordinator releases them for it,
    so the cache can evict those shards again instead of overflowing its capacity."""
    cache, _ = start_cache(corpus, tmp_path, capacity=2)
    ray.get([cache.acquire.remote(s, 0, "killed") for s in (0, 1)])
    ray.get(cache.acquire.remote(2, 0, "alive"))
    assert ray.get(cache.stats.remote())["pinned"] == [0, 1, 2]
    ray.get(cache.release_holder.remote("killed"))
    assert ray.get(cache.stats.remote())["pinned"] == [2]
    ray.get(cache.acquire.remote(3, 0, "alive"))
    stats = ray.get(cache.stats.remote())
    # The released shards made room: no overflow beyond the three pins above, and both are gone.
    assert stats["overflows"] == 1 and not {0, 1} & set(stats["cached"])


@ray_test
def test_cache_directories_of_dead_processes_are_removed(corpus, tmp_path):
    """Issue 15, defect 10: a cache's directory is named after its process; the ones a killed coordinator or
    a Ctrl-C left behind go when the node's next cache starts (a live process's stays)."""
    root = tmp_path / "cache"
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan, live, other = root / f"{'a' * 12}-{dead.pid}", root / f"{'b' * 12}-{os.getpid()}", root / f"keep-{dead.pid}"
    for d in (orphan, live, other):
        d.mkdir(parents=True)
        (d / "000001.parquet").write_bytes(b"x" * 1000)
    ray.get(start_cache(corpus, tmp_path)[0].stats.remote())
    assert not orphan.exists() and live.exists() and other.exists()


def test_a_brief_object_store_outage_is_retried(make_cfg, s3_bucket, s3_faults, tmp_path, monkeypatch):
    """Issue 15, defect 11: botocore's connection errors are not OSError, so the cache did not retry them
    and a brief outage failed the step at once. (One try per request here, so the cache's retries show.)"""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    manifest = ensure_corpus(make_cfg(f"data.cache_dir={s3_bucket}/data"))
    sizes = tuple(s["samples"] for s in read_manifest(manifest)["splits"]["train"]["shards"])
    cache = ShardCache(manifest, order.Layout(0, sizes, 1), 3, str(tmp_path / "cache"))
    with s3_faults.outage():
        threading.Timer(4.0, lambda: setattr(s3_faults, "down", False)).start()  # s3fs retries ~2 s itself
        got = cache.acquire(1, 0, "reader")
    assert Path(got["path"]).exists() and cache.stats()["retries"] >= 1
    cache.close()
    s3fs.S3FileSystem.clear_instance_cache()


@ray_test
def test_the_coordinator_reads_the_caches_counts_in_one_get_and_a_dead_cache_as_gone(corpus, tmp_path):
    """etrain/control/data_plane.py's `_answers`: every live cache's counts, and None for one whose node is gone
    (drawn), however many caches there are."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    count = rng.randrange(2, 5)
    dead = rng.randrange(count)
    print(f"seed {seed}: {count} caches, cache {dead} killed")
    caches = [start_cache(corpus, tmp_path / str(i))[0] for i in range(count)]
    ray.get([c.stats.remote() for c in caches])
    ray.kill(caches[dead])

    def gone() -> bool:
        try:
            ray.get(caches[dead].stats.remote(), timeout=5)
            return False
        except ray.exceptions.RayActorError:
            return True

    wait_until("the killed cache is dead", gone)
    refs = [c.stats.remote() for c in caches]
    ray.wait(refs, num_returns=len(refs))
    answers = _answers(refs)
    live = [r for i, r in enumerate(refs) if i != dead]
    assert answers[refs[dead]] is None
    assert all(answers[r]["fetched_shards"] >= 0 for r in live)
    assert _answers(live) == {r: answers[r] for r in live}  # all alive: the one get
    for c in caches:
        ray.kill(c)
