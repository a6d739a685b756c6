"""The benchmarks' own code paths, on tiny inputs, so a change elsewhere cannot silently break them."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def test_throughput_plain_variant_runs(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "throughput.py"),
            "--variant",
            "plain",
            "--steps",
            "8",
            "--layers",
            "1",
            "--width",
            "64",
            "--batch",
            "4",
            "--cpus",
            "1",
            "--data",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    times = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(times) == 8 and times == sorted(times)


def test_data_bench_direct_reader_delivers_every_row(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import data

    manifest = data.make_shards(tmp_path, shards=3, shard_mb=1)
    result = data.read_direct(manifest)
    assert result["mb_per_s"] > 0
    assert data.layout_of(manifest).num_samples == 3 * (2**20 // 129)
    assert np.isfinite(result["mb_per_s"])


def test_comm_bench_runs_a_straggler_variant_and_compares(ray_session, data_dir, tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import comm

    small = ["data.corpus_bytes=1500000", "data.shard_bytes=200000"]  # the session's corpus
    result = comm.run_variant("balanced", [*comm.STRAGGLER["balanced"], *small], 14, tmp_path, data_dir)
    assert result["samples_per_s"] > 0 and sum(result["final_shares"]) == 16
    assert result["bytes_per_worker_step"] == result["dense_bytes_per_worker_step"] > 0
    ratios = comm.compare({"static": result | {"samples_per_s": result["samples_per_s"] / 2}, "balanced": result})
    assert ratios["balanced_vs_static_throughput"] == 2.0


def test_finetune_bench_runs_a_large_batch_variant_and_compares(ray_session, data_dir, tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import finetune

    small = ("data.corpus_bytes=1500000", "data.shard_bytes=200000")  # the session's corpus
    result = finetune.run_large("lamb", 2, str(tmp_path), data_dir, 0, small)
    assert result["samples"] == 2 * finetune.LARGE_BATCH and result["optimizer_bytes_per_worker"] > 0
    assert result["checkpoint_bytes"] > 0 and np.isfinite(result["eval_loss"])
    figures = {k: {"median": v} for k, v in result.items()}
    ratios = finetune.compare({"adamw": figures, "lamb": {**figures, "eval_loss": {"median": 2 * result["eval_loss"]}}})
    assert ratios == {"lamb_eval_loss_vs_adamw": 1.0}
    descriptions = finetune.package_descriptions(tmp_path / "p.jsonl").read_text().splitlines()
    assert descriptions and all(len(json.loads(line)["text"]) > 500 for line in descriptions)


def test_chaos_bench_kills_on_its_schedule_and_counts_what_was_committed(ray_session, data_dir):
    import argparse
    import importlib.util

    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_chaos", ROOT / "bench" / "chaos.py")  # tests/ has a chaos
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(steps=8, batch=16, seed=3, data=data_dir)
    kills = bench.schedule(args, 3)
    assert [step for step, _ in kills] == [3, 6] and {rank for _, rank in kills} <= {0, 1}
    # three workers and no pool: each kill fires at its step (a replacement's start time would decide otherwise)
    small = ("data.corpus_bytes=1500000", "data.shard_bytes=200000", "timeouts.step_s=15", "timeouts.collective_s=5")
    solo = ("cluster.num_workers=3", "cluster.warm_pool=0")
    result = bench.run_ours(args, 3, small + solo, ready_pool=False)
    assert result["kills"] == result["failures"] == 2 and result["worlds"] == [1, 2, 3], result
    assert result["every_sample_once"] and result["tokens_per_s"] > 0, result
    assert result["committed_share"] == 8 / (8 + 2), result  # each killed step is redone by the survivors
