"""Data path, side by side in one run: our streaming cache vs a direct local read vs Ray Data.

1. Throughput over one epoch in the training order: shards streamed from a local
   S3 server (moto, 127.0.0.1) through our per-node cache (3 slots) vs pyarrow
   reading the same shards from local disk (the ceiling) vs
   `ray.data.read_parquet(s3://...).iter_torch_batches()`.
2. Cache hit rate over two epochs with more shards than cache slots.
3. A joining worker's first batch when its shard is cached (a resize must not
   pay a pipeline start-up).
4. Share of step time spent waiting for data in a tiny training run on S3.

    python bench/data.py [--shards 6] [--shard-mb 64]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import ray

from etrain.data import order
from etrain.data.cache import ShardCache
from etrain.data.shards import SplitWriter, decode, read_manifest, write_manifest
from etrain.data.stream import StreamingReader

RESULTS = Path(__file__).resolve().parent / "results"
SEQ = 128
BATCH = 2048  # samples per read: a large global batch, so the reader, not the model, is timed


def start_s3() -> str:
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False).start()
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    boto3.client("s3").create_bucket(Bucket="bench")
    return "s3://bench"


def make_shards(local: Path, shards: int, shard_mb: int) -> str:
    rows = shard_mb * 2**20 // (SEQ + 1)
    writer = SplitWriter(str(local), "train", SEQ + 1, "uint8", rows * (SEQ + 1))
    rng = np.random.default_rng(0)
    for _ in range(shards):
        writer.add(rng.integers(1, 256, (rows, SEQ + 1), dtype=np.uint8), [[f"random#{i}"] for i in range(rows)])
    writer.flush()
    write_manifest(
        str(local),
        seq_len=SEQ,
        dtype="uint8",
        vocab_size=256,
        tokenizer="bytes",
        splits={"train": writer.shards, "eval": []},
        source={"kind": "bench"},
    )
    return str(local / "manifest.json")


def upload(local: Path, bucket: str, name: str) -> str:
    import fsspec

    fsspec.filesystem("s3").put(str(local) + "/", f"{bucket}/{name}/", recursive=True)
    return f"{bucket}/{name}/manifest.json"


def layout_of(manifest: str) -> order.Layout:
    return order.Layout(0, tuple(s["samples"] for s in read_manifest(manifest)["splits"]["train"]["shards"]), 1)


def read_ours(manifest: str, epochs: int, cache_dir: str) -> dict:
    layout = layout_of(manifest)
    cache = ray.remote(ShardCache).options(num_cpus=0, max_concurrency=8).remote(manifest, layout, 3, cache_dir)
    reader = StreamingReader(manifest, layout, cache, holder="reader")
    started, wait, nbytes = time.perf_counter(), 0.0, 0
    epoch_times, snapshots = [], []
    for epoch in range(epochs):
        snapshots.append(ray.get(cache.stats.remote()))
        t0 = time.perf_counter()
        for cursor in range(epoch * layout.num_samples, (epoch + 1) * layout.num_samples, BATCH):
            rows, stats = reader.get(order.take(layout, cursor, BATCH), cursor)
            wait += stats["wait_s"]
            nbytes += rows.nbytes
        epoch_times.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - started
    cache_stats = ray.get(cache.stats.remote())
    first = time.perf_counter()  # a worker joining now, at the current cursor, with its shard cached
    joiner = StreamingReader(manifest, layout, cache, holder="joiner")
    joiner.get(order.take(layout, cursor, BATCH), cursor)
    join_s = time.perf_counter() - first
    ray.get(cache.close.remote())
    hits, misses = (cache_stats[k] - snapshots[-1][k] for k in ("hits", "misses"))  # the last epoch: steady state
    return {
        "mb_per_s": nbytes / 2**20 / elapsed,
        "epoch_s": epoch_times,
        "cache": cache_stats,
        "data_wait_s": wait,
        "hit_rate": hits / (hits + misses),
        "join_first_batch_s": join_s,
    }


def read_direct(manifest: str) -> dict:
    layout = layout_of(manifest)
    root = Path(manifest).parent
    shards = read_manifest(manifest)["splits"]["train"]["shards"]
    started, nbytes, views = time.perf_counter(), 0, {}
    for cursor in range(0, layout.num_samples, BATCH):
        ids = order.take(layout, cursor, BATCH)
        which = layout.shard_of(ids)
        for s in np.unique(which):
            if s not in views:
                views = {k: v for k, v in views.items() if k in which}
                views[s] = decode(pq.read_table(root / shards[s]["path"], memory_map=True), SEQ + 1, np.dtype(np.uint8))
        out = np.empty((len(ids), SEQ + 1), np.uint8)
        for s in np.unique(which):
            out[which == s] = views[s][ids[which == s] - layout.starts[s]]
        nbytes += out.nbytes
    return {"mb_per_s": nbytes / 2**20 / (time.perf_counter() - started)}


def read_ray_data(manifest: str) -> dict:
    import torch

    root = manifest.rsplit("/", 1)[0]
    paths = [f"{root}/{s['path']}" for s in read_manifest(manifest)["splits"]["train"]["shards"]]

    def to_tensor(batch):
        return torch.from_numpy(
            np.frombuffer(b"".join(batch["tokens"]), np.uint8).reshape(len(batch["tokens"]), SEQ + 1)
        )

    started, nbytes, first = time.perf_counter(), 0, None
    for batch in ray.data.read_parquet(paths).iter_torch_batches(batch_size=BATCH, collate_fn=to_tensor):
        first = first or time.perf_counter() - started
        nbytes += batch.numel()
    return {"mb_per_s": nbytes / 2**20 / (time.perf_counter() - started), "first_batch_s": first}


def train_wait_share(bucket: str, tmp: Path) -> dict:
    from etrain.core.config import load_config
    from etrain.core.records import read_jsonl
    from etrain.data.embedded import ensure_corpus
    from etrain.driver.job import new_run_dir, train

    base = [f"data.cache_dir={tmp / 'corpus'}", "data.shard_bytes=200000", "data.corpus_bytes=2000000"]
    local = Path(ensure_corpus(load_config("tiny", base))).parent
    manifest = upload(local, bucket, "corpus")
    cfg = load_config(
        "tiny",
        [
            *base,
            f"data.source={manifest}",
            "train.steps=60",
            "train.global_batch=64",
            "train.micro_batch=32",
            "train.eval_every=0",
            "checkpoint.every=0",
            f"run.root={tmp / 'runs'}",
        ],
    )
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    steady = steps[1:]  # the first step waits for the first shard: a start-up cost, not a stall
    return {
        "steps": len(steps),
        "shards_fetched": sum(r["fetched_shards"] for r in steps),
        "wait_share": sum(r["data_wait_s"] for r in steady) / sum(r["step_time_s"] for r in steady),
        "first_step_wait_s": steps[0]["data_wait_s"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=6)
    p.add_argument("--shard-mb", type=int, default=64)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-data-"))
    bucket = start_s3()
    ray.init(address="local", logging_level="warning")
    local = make_shards(tmp / "shards", args.shards, args.shard_mb)
    remote = upload(tmp / "shards", bucket, "shards")
    results = {"args": vars(args)}
    results["direct_local"] = read_direct(local)
    print(f"direct pyarrow, local disk      {results['direct_local']['mb_per_s']:8.0f} MB/s", flush=True)
    results["ours_s3"] = read_ours(remote, 2, str(tmp / "cache"))
    print(
        f"ours, S3 through 3-shard cache  {results['ours_s3']['mb_per_s']:8.0f} MB/s  hit rate "
        f"{results['ours_s3']['hit_rate']:.1%}"
        f"  join→first batch {results['ours_s3']['join_first_batch_s'] * 1000:.0f} ms",
        flush=True,
    )
    results["ray_data_s3"] = read_ray_data(remote)
    print(
        f"Ray Data read_parquet, S3       {results['ray_data_s3']['mb_per_s']:8.0f} MB/s  first batch "
        f"{results['ray_data_s3']['first_batch_s']:.1f} s",
        flush=True,
    )
    results["training"] = train_wait_share(bucket, tmp)
    print(f"tiny training on S3: data wait {results['training']['wait_share']:.2%} of step time", flush=True)
    ours, ceiling = results["ours_s3"], results["direct_local"]["mb_per_s"]
    results["ratios"] = {
        "ours_vs_local_ceiling": ours["mb_per_s"] / ceiling,
        "ours_vs_ray_data": ours["mb_per_s"] / results["ray_data_s3"]["mb_per_s"],
        "second_epoch_hit_rate": ours["hit_rate"],
        "join_first_batch_s": ours["join_first_batch_s"],
        "train_data_wait_share": results["training"]["wait_share"],
    }
    print("\n" + "\n".join(f"{k:28s} {v:8.3f}" for k, v in results["ratios"].items()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "data.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwritten: {RESULTS / 'data.json'}")


if __name__ == "__main__":
    main()
