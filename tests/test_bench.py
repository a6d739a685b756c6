"""The benchmarks' own code paths, on tiny inputs, so a change elsewhere cannot silently break them."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from etrain.core.config import override
from etrain.core.records import read_jsonl

ROOT = Path(__file__).resolve().parent.parent


def comm_figures(records: list[dict], warmup: int) -> dict:
    """What bench/comm.py reports of a run, computed here from its records another way: the samples of the steps
    after step `warmup + 1` (their batches) over the time since that step ended; means of per-worker bytes."""
    steps = [r for r in records if r["kind"] == "train"]
    start = next(r for r in steps if r["step"] == warmup + 1)
    counted = [r for r in steps if r["step"] > start["step"]]
    return {
        "samples_per_s": sum(r["batch"] for r in counted) / (counted[-1]["time"] - start["time"]),
        "eval_loss": max((r for r in records if r["kind"] == "eval"), key=lambda r: r["step"])["eval_loss"],
        "final_loss": counted[-1]["loss"],
        "bytes_per_worker_step": statistics.fmean(r["comm_bytes"] / r["world_size"] for r in steps),
        "dense_bytes_per_worker_step": statistics.fmean(r["dense_bytes"] / r["world_size"] for r in steps),
        "last_step_bytes_per_worker": counted[-1]["comm_bytes"] / counted[-1]["world_size"],
        "optimizer_bytes_per_worker": max(counted[-1]["optimizer_bytes"]),
    }


def finetune_figures(records: list[dict]) -> dict:
    """What bench/finetune.py measures of a run, from its records: the step time is the middle of the sorted
    times of the steps past the first quarter (the mean of the two middle ones for an even count)."""
    steps = [r for r in records if r["kind"] == "train"]
    times = sorted(r["step_time_s"] for r in steps if r["step"] > len(steps) // 4)
    half = len(times) // 2
    return {
        "eval_loss": max((r for r in records if r["kind"] == "eval"), key=lambda r: r["step"])["eval_loss"],
        "step_s": times[half] if len(times) % 2 else (times[half - 1] + times[half]) / 2,
        "optimizer_bytes_per_worker": max(steps[-1]["optimizer_bytes"]),
        "checkpoint_bytes": max((r for r in records if r["kind"] == "checkpoint"), key=lambda r: r["step"])["bytes"],
        "samples": sum(r["batch"] for r in steps),
    }


def fake_train(runs: dict[str, list[dict]]):
    """`train` for a bench's own code path without Ray: writes the records `runs` holds for the run's name."""

    def train(cfg, run_dir, **_):
        with open(Path(run_dir) / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in runs[cfg.run.name])

    return train


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


def test_gpu_check_runs_every_path_on_cpu_and_ours_trains_as_plain_torch(tmp_path):
    """bench/gpu.py's smoke test (no GPU here): plain torch, our worker's step and fused AdamW on the GPT and the
    Llama, bf16 and fp16 with GradScaler, without Ray; the same losses from the same weights and rows."""
    out = tmp_path / "gpu.json"
    args = ["--device", "cpu", "--rounds", "1", "--steps", "3", "--warmup", "2", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "bench/gpu.py", *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    variants = {f"{m}/{p}/{loop}" for m in ("gpt", "llama") for p in ("bf16", "fp16") for loop in ("plain", "ours")}
    assert variants <= set(report["figures"])
    assert all(f["tokens_per_s"]["median"] > 0 and f["mfu"] is None for f in report["figures"].values())  # no CPU MFU
    gaps = {k: v for k, v in report["ratios"].items() if "loss gap" in k}
    assert len(gaps) == 4 and all(v < 1e-5 for v in gaps.values()), gaps
    assert "unavailable" in report["nvml"]
    assert report["without_ray"]  # the machine that lends a GPU has no Ray
    refused = subprocess.run([sys.executable, "bench/gpu.py"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert refused.returncode == 2 and "--device cpu" in refused.stderr


def test_gpu_check_builds_llama_3_2_1b_and_3b_at_their_published_sizes():
    """bench/gpu.py's big models as it configures them for a GPU, built on the meta device: Llama 3.2 1B and 3B's
    shapes and published parameter counts (tied heads), torchtitan's FLOPs per token worked by hand (an untied head
    adds its embedding table to ours only), and the memory model's bound inside an H200's 141 GB."""
    import torch

    from etrain.core.models import make_model

    sys.path.insert(0, str(ROOT / "bench"))
    import gpu

    args = gpu.parse([])
    assert args.models == ["gpt", "llama", "llama-1b", "llama-3b"]
    assert gpu.parse(["--device", "cpu"]).models == ["gpt", "llama"]  # the big ones' paths are the small Llama's
    published = {  # layers, width, heads, key/value heads, MLP, vocabulary; parameters (Hugging Face's safetensors)
        "llama-1b": ((16, 2048, 32, 8, 8192, 128256), 1_235_814_400),
        "llama-3b": ((28, 3072, 24, 8, 8192, 128256), 3_212_749_824),
    }
    for name, (shape, count) in published.items():
        cfg = gpu.config(name, "bf16", args)
        m = cfg.model
        assert (m.n_layer, m.d_model, m.n_head, m.kv_heads, m.ffn_width, m.vocab_size) == shape
        llama_3_2 = ("llama", True, 5e5, 32, 2048)  # family, tied head, rope theta, its scaling's factor, tokens
        assert (m.family, m.tie_weights, m.rope_theta, m.rope_scaling.factor, m.seq_len) == llama_3_2
        with torch.device("meta"):
            model = make_model(m)
        assert model.num_params() == pytest.approx(count, rel=5e-3) and m.param_count() == model.num_params()
        by_hand = 6 * model.num_params() + 12 * m.n_layer * m.n_head * (m.d_model // m.n_head) * m.seq_len
        assert gpu.flops_counts(model) == {"torchtitan": by_hand, "etrain": by_hand}
        assert cfg.worker_memory() < 141e9, name
        untied = override(cfg, {"model.tie_weights": False}).model
        with torch.device("meta"):
            counts = gpu.flops_counts(make_model(untied))
        assert counts["torchtitan"] == by_hand and counts["etrain"] - by_hand == 6 * m.vocab_size * m.d_model


def test_gpu_check_leaves_out_a_model_out_of_memory_and_holds_the_rest_to_the_targets(monkeypatch):
    """A variant out of GPU memory (the 3B on an 80 GB card) is reported and its model left out from then on; the
    other model's figures are still held to the targets (ours / plain >= 0.95, MFU >= 0.35)."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import gpu

    def measure(loop, cfg, device, warmup, steps):
        if cfg.model.n_layer == 28:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        tokens_per_s = {"plain": 100.0, "ours": 96.0, "fused": 110.0}[loop]
        return {"tokens_per_s": tokens_per_s, "step_s": 1.0, "mfu": tokens_per_s / 320, "mfu_etrain": None,
                "flops_per_token": {}, "params": 1, "peak_memory_bytes": 5, "predicted_memory_bytes": 6,
                "batch": [16, 4, 2048], "losses": [2.0, 1.0]}  # fmt: skip

    monkeypatch.setattr(gpu, "measure", measure)
    args = gpu.parse(["--models", "llama-3b", "llama-1b", "--rounds", "2"])
    runs, failed = {}, {}
    for round_ in range(2):
        gpu.run_round(round_, args, torch.device("cpu"), runs, failed)
    assert failed == {"llama-3b/bf16/plain": "CUDA out of memory. Tried to allocate 2.00 GiB"}
    assert {k: len(v) for k, v in runs.items()} == {f"llama-1b/bf16/{loop}": 2 for loop in ("plain", "ours", "fused")}
    report = gpu.summarize(runs, failed, args, torch.device("cpu"), [1.0, 1.0])
    assert report["targets"] == {
        "llama-3b/bf16: ours / plain >= 0.95": {"value": None, "met": None},
        "llama-3b/bf16: MFU of ours >= 0.35": {"value": None, "met": None},
        "llama-1b/bf16: ours / plain >= 0.95": {"value": 0.96, "met": True},
        "llama-1b/bf16: MFU of ours >= 0.35": {"value": 0.3, "met": False},
    }
    assert report["failed"] == failed and report["figures"]["llama-1b/bf16/ours"]["rounds"] == 2


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
    records = read_jsonl(tmp_path / "balanced" / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 15))
    expected = comm_figures(records, comm.WARMUP)
    assert {k: result[k] for k in expected} == pytest.approx(expected, rel=1e-9)
    assert result["final_shares"] == [r for r in records if r["kind"] == "train"][-1]["shares"]


def test_comm_bench_compares_the_figures_of_its_variants_records(tmp_path, monkeypatch):
    """run_variant and compare on two runs' records (a slow warm-up, then uneven steps): the ratios are those of
    the figures computed here from the records, so a wrong window, figure or ratio shows."""
    sys.path.insert(0, str(ROOT / "bench"))
    import comm

    def run(step_s: list[float], eval_loss: float, bytes_: int) -> list[dict]:
        times = np.cumsum(step_s).tolist()
        steps = [
            {"kind": "train", "step": s, "world_size": 2, "batch": 16, "cursor": 16 * s, "time": 1000.0 + times[s - 1],
             "loss": 4.0 - s / 8, "comm_bytes": bytes_ * (s % 3 + 1), "dense_bytes": 2 * bytes_,
             "optimizer_bytes": [7 * bytes_, 5 * bytes_], "shares": [8 + s % 2, 8 - s % 2]}
            for s in range(1, len(step_s) + 1)
        ]  # fmt: skip
        return [*steps, {"kind": "eval", "step": len(step_s), "eval_loss": eval_loss, "time": 1000.0 + times[-1]}]

    warm = [3.0] * (comm.WARMUP + 1)
    runs = {"static": run([*warm, 0.5, 1.0, 0.5], 3.0, 400), "balanced": run([*warm, 0.25, 0.75, 0.25], 3.3, 100)}
    monkeypatch.setattr(comm, "train", fake_train(runs))
    results = {name: comm.run_variant(name, [], 14, tmp_path, str(tmp_path / "data")) for name in runs}
    figures = {name: comm_figures(records, comm.WARMUP) for name, records in runs.items()}
    for name in runs:
        assert {k: results[name][k] for k in figures[name]} == pytest.approx(figures[name], rel=1e-12), name
    assert results["balanced"]["final_shares"] == runs["balanced"][-2]["shares"]
    assert comm.compare(results) == pytest.approx(
        {
            "balanced_vs_static_throughput": figures["balanced"]["samples_per_s"] / figures["static"]["samples_per_s"],
            "balanced_eval_loss_vs_static": figures["balanced"]["eval_loss"] / figures["static"]["eval_loss"] - 1,
        },
        rel=1e-12,
    )


def test_finetune_bench_runs_a_large_batch_variant_and_compares(ray_session, data_dir, tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import finetune

    small = ("data.corpus_bytes=1500000", "data.shard_bytes=200000")  # the session's corpus
    result = finetune.run_large("lamb", 2, str(tmp_path), data_dir, 0, small)
    assert result["samples"] == 2 * finetune.LARGE_BATCH and result["optimizer_bytes_per_worker"] > 0
    assert result["checkpoint_bytes"] > 0 and np.isfinite(result["eval_loss"])
    records = read_jsonl(tmp_path / "lamb-0" / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert result == pytest.approx(finetune_figures(records), rel=1e-9)
    descriptions = finetune.package_descriptions(tmp_path / "p.jsonl").read_text().splitlines()
    assert descriptions and all(len(json.loads(line)["text"]) > 500 for line in descriptions)


def test_finetune_bench_compares_the_medians_of_its_rounds(tmp_path, monkeypatch):
    """run_large, summary and compare as main() chains them, on three rounds' records per variant: each figure is
    the one computed here from the records, each round's spread its min and max, each ratio one of medians."""
    sys.path.insert(0, str(ROOT / "bench"))
    import finetune
    import rounds

    def run(eval_loss: float, step_s: list[float]) -> list[dict]:
        steps = [
            {"kind": "train", "step": s, "world_size": 2, "batch": finetune.LARGE_BATCH, "step_time_s": t,
             "optimizer_bytes": [100 * s, 120 * s], "time": 1000.0 + s}
            for s, t in enumerate(step_s, 1)
        ]  # fmt: skip
        saves = [{"kind": "checkpoint", "step": s, "bytes": 500 + s} for s in (4, len(step_s))]
        return [*steps, *saves, {"kind": "eval", "step": len(step_s), "eval_loss": eval_loss}]

    slow_start = [9.0, 9.0, 1.0, 3.0, 2.0, 5.0, 4.0, 1.5]  # the first quarter left out: a median of 2.5, not 3.5
    losses = {"adamw": [3.0, 2.0, 2.2], "lamb": [2.0, 4.0, 2.6]}  # medians 2.2 and 2.6; means 2.4 and 2.87
    runs = {
        f"{name}-{rnd}": run(loss, [t * (rnd + 1) for t in slow_start])
        for name, by_round in losses.items()
        for rnd, loss in enumerate(by_round)
    }
    monkeypatch.setattr(finetune, "train", fake_train(runs))
    measured = {
        name: [
            finetune.run_large(name, len(slow_start), str(tmp_path), str(tmp_path / "data"), rnd) for rnd in (0, 1, 2)
        ]
        for name in losses
    }
    for name, by_round in measured.items():
        for rnd, result in enumerate(by_round):
            assert result == pytest.approx(finetune_figures(runs[f"{name}-{rnd}"]), rel=1e-12), (name, rnd)
    results = {name: rounds.summary(by_round) for name, by_round in measured.items()}
    for name, by_round in measured.items():
        for key in by_round[0]:
            values = sorted(r[key] for r in by_round)
            assert results[name][key] == {"median": values[1], "min": values[0], "max": values[2]}, (name, key)
    middle = {name: sorted(by_round)[1] for name, by_round in losses.items()}
    assert finetune.compare(results) == pytest.approx({"lamb_eval_loss_vs_adamw": middle["lamb"] / middle["adamw"] - 1})


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
    # the badput split: each kill detected and the group re-formed, no step redone after a rewind, all 8 kept
    assert result["detection_s"] > 0 and result["re_forming_s"] > 0 and result["redone_steps_s"] == 0, result
    assert result["kept_steps"] == 8 and result["productive_s"] > 0 < result["step_s"], result


def hpo_search(curves: list[list[float]], every: int = 10) -> dict:
    """A search record as bench/hpo.py keeps one: each trial's evaluations every `every` steps, in proposal order."""
    return {
        "trials": [
            {"number": n, "status": "completed", "evals": [[every * (i + 1), v] for i, v in enumerate(c)]}
            for n, c in enumerate(curves)
        ]
    }


@pytest.mark.parametrize("concurrency", [1, 2])
def test_hpo_replay_prunes_as_ray_asha_does(make_cfg, concurrency):
    """Rungs at 10, 20, 40 (reduction 2, grace one evaluation): trial 1 falls below the median at 10 and trial 2 at
    20; trials 0 and 3 lead at every rung they reach. Worked by hand; at concurrency 2 the events interleave (trial
    0 and 1 at step 10 together, the earlier trial first) and the outcome is the same."""
    sys.path.insert(0, str(ROOT / "bench"))
    import hpo

    base = make_cfg("train.steps=60", "train.eval_every=10")
    search = hpo_search(
        [
            [3.0, 2.8, 2.7, 2.6, 2.5, 2.4],
            [3.5, 3.4, 3.3, 3.2, 3.1, 3.0],
            [2.9, 2.9, 2.9, 2.9, 2.9, 2.9],
            [2.0, 1.9, 1.7, 1.5, 1.45, 1.4],
        ]
    )
    assert hpo.replay(search, base, 2, 1, concurrency) == {"trial_steps": 60 + 10 + 20 + 60, "best_eval_loss": 1.4}


def test_hpo_replay_never_spends_more_or_finds_better_than_no_pruning(make_cfg):
    seed = int(np.random.default_rng().integers(1 << 16))
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    base = make_cfg("train.steps=60", "train.eval_every=10")
    sys.path.insert(0, str(ROOT / "bench"))
    import hpo

    for _ in range(20):
        starts, rates = rng.uniform(2.5, 4.0, 24), rng.uniform(0.02, 0.2, 24)
        curves = [list(s * np.exp(-r * np.arange(1, 7))) for s, r in zip(starts, rates)]
        full = min(c[-1] for c in curves)
        for reduction in (2, 3, 4):
            for grace in (1, 2, 3):
                out = hpo.replay(hpo_search(curves), base, reduction, grace, int(rng.integers(1, 4)))
                assert 24 * 10 * grace <= out["trial_steps"] <= 24 * 60
                assert out["best_eval_loss"] >= full
        leader = [list(np.full(6, 0.5) - np.arange(6) * 0.01)]  # ahead at every rung: never stopped
        assert hpo.replay(hpo_search(curves + leader), base, 3, 1, 2)["best_eval_loss"] == leader[0][-1]


def test_hpo_trials_to_reach_and_the_median_interval():
    sys.path.insert(0, str(ROOT / "bench"))
    import hpo

    search = hpo_search([[3.0], [2.5], [2.7], [2.2]])
    search["trials"][1]["status"] = "pruned"  # a pruned trial's loss is not an answer
    assert [hpo.trials_to_reach(search, t) for t in (3.0, 2.6, 2.5, 2.2, 2.1)] == [1, 4, 4, 4, 5]
    low, high = hpo.bootstrap_median([5, 5, 5, 5])
    assert low == high == 5
    low, high = hpo.bootstrap_median(list(range(1, 12)))
    assert 1 <= low < 6 < high <= 11


def test_hpo_objective_in_process_is_the_jobs_training(ray_session, make_cfg, tmp_path):
    """bench/hpo.py's trials train in their own process: the same model, optimizer, schedule and samples as a job
    with one worker, so the same eval losses up to the order of float sums (a job sums micro-batch gradients)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import hpo

    from etrain.driver.job import resolve_data, train

    cfg = make_cfg("cluster.num_workers=1", "train.global_batch=8", "train.micro_batch=8", "optim.lr=0.01")
    cfg = override(cfg, {"data.source": resolve_data(cfg)})
    (tmp_path / "process").mkdir()
    seen = []
    hpo.train_in_process(cfg, tmp_path / "process", on_eval=seen.append)
    train(cfg, tmp_path / "job", progress=False)
    process = [(r["step"], r["eval_loss"]) for r in read_jsonl(tmp_path / "process" / "metrics.jsonl")]
    job = [(r["step"], r["eval_loss"]) for r in read_jsonl(tmp_path / "job" / "metrics.jsonl") if r["kind"] == "eval"]
    assert [s for s, _ in process] == [s for s, _ in job] == [4, 8]
    assert [v for _, v in process] == pytest.approx([v for _, v in job], rel=1e-4)
    assert [(r["step"], r["eval_loss"]) for r in seen] == process
