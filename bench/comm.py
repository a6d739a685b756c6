"""Gradient sync, side by side in one run: the tiny GPT, 2 workers, one local Ray instance.

1. A straggler (rank 1 computes 2x slower from step 2, an injected delay): the
   static equal split vs our speed-proportional rebalancing vs the
   parameter-server mode, as throughput (samples/s after warm-up) over static.
2. Compression: each mode's bytes handed to the collectives per worker per step
   vs uncompressed (over the whole run, which starts with `comm.compress_start`
   plain steps, and once compressing), and the eval loss after the same steps.
3. ZeRO-1: optimizer state held per worker vs replicated.

    python bench/comm.py [--steps 300] [--straggler-steps 60] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import ray
from rounds import publish

from etrain.core.config import load_config
from etrain.core.records import read_jsonl
from etrain.driver.job import new_run_dir, train

RESULTS = Path(__file__).resolve().parent / "results"
SLOW = "faults=[{rank: 1, step: 2, kind: slow, factor: 2}]"
# PS mode twice: at the seeds' 300 ms window, and at a window below this model's ~0.1 s step, where a
# late push (the straggler's extra ~0.1 s) is no longer waited for.
STRAGGLER = {
    "static": [SLOW, "balance.enabled=false"],
    "balanced": [SLOW],
    "ps": [SLOW, "comm.mode=ps"],
    "ps_short_window": [SLOW, "comm.mode=ps", "comm.ps_window_s=0.02"],
}
SYNC = {
    "none": [],
    "fp16": ["comm.compression=fp16"],
    "bf16": ["comm.compression=bf16"],
    "powersgd": ["comm.compression=powersgd"],
    "topk": ["comm.compression=topk"],
    "zero": ["comm.zero=true", "checkpoint.every=100"],
}
WARMUP = 10  # steps left out of throughput: start-up, first buckets, the balancer's first measurements


def base_overrides(name: str, steps: int, root: Path | str, data_dir: str) -> list[str]:
    """The tiny GPT's 2-worker run every variant starts from: evaluated once at the end, no checkpoints."""
    return [
        f"data.cache_dir={data_dir}",
        f"run.root={root}",
        f"run.name={name}",
        f"train.steps={steps}",
        "train.eval_every=0",
        "checkpoint.every=0",
        "cluster.warm_pool=0",
    ]


def run_variant(name: str, overrides: list[str], steps: int, root: Path, data_dir: str) -> dict:
    cfg = load_config("tiny", [*base_overrides(name, steps, root, data_dir), *overrides])
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps_ = [r for r in records if r["kind"] == "train"]
    a, b = steps_[min(WARMUP, len(steps_) - 2)], steps_[-1]
    result = {
        "samples_per_s": (b["cursor"] - a["cursor"]) / (b["time"] - a["time"]),
        "eval_loss": [r for r in records if r["kind"] == "eval"][-1]["eval_loss"],
        "final_loss": b["loss"],
    }
    if "comm_bytes" in b:
        world = b["world_size"]
        result["bytes_per_worker_step"] = sum(r["comm_bytes"] for r in steps_) / len(steps_) / world
        result["dense_bytes_per_worker_step"] = sum(r["dense_bytes"] for r in steps_) / len(steps_) / world
        result["last_step_bytes_per_worker"] = b["comm_bytes"] / world  # after comm.compress_start: compressing
        result["optimizer_bytes_per_worker"] = max(b["optimizer_bytes"])
    if name == "balanced":
        result["final_shares"] = b["shares"]
    if "max_staleness" in b:
        result["max_staleness"] = max(r["max_staleness"] for r in steps_)
    return result


def compare(results: dict) -> dict:
    """The ratios the issue asks for, from whichever variants ran."""
    out = {}
    if "static" in results:
        static = results["static"]["samples_per_s"]
        out |= {
            f"{k}_vs_static_throughput": results[k]["samples_per_s"] / static
            for k in ("balanced", "ps", "ps_short_window")
            if k in results
        }
        out |= {
            f"{k}_eval_loss_vs_static": results[k]["eval_loss"] / results["static"]["eval_loss"] - 1
            for k in ("balanced", "ps", "ps_short_window")
            if k in results
        }
    if "none" in results:
        none = results["none"]
        for k in ("fp16", "bf16", "powersgd", "topk"):
            if k in results:
                out[f"{k}_bytes_vs_none"] = results[k]["bytes_per_worker_step"] / none["bytes_per_worker_step"]
                out[f"{k}_bytes_vs_none_compressing"] = (
                    results[k]["last_step_bytes_per_worker"] / none["last_step_bytes_per_worker"]
                )
                out[f"{k}_eval_loss_change"] = results[k]["eval_loss"] / none["eval_loss"] - 1
        if "zero" in results:
            out["zero_optimizer_bytes_vs_replicated"] = (
                results["zero"]["optimizer_bytes_per_worker"] / none["optimizer_bytes_per_worker"]
            )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="steps of each compression / ZeRO run")
    parser.add_argument("--straggler-steps", type=int, default=60, help="steps of each straggler run")
    parser.add_argument("--only", nargs="*", choices=[*STRAGGLER, *SYNC], help="run only these variants")
    parser.add_argument(
        "--data", default=str(Path.home() / ".cache/etrain/data"), help="where the embedded corpus is built"
    )
    parser.add_argument("--out", default=str(RESULTS / "comm.json"), help="results file ('' to skip)")
    args = parser.parse_args(argv)
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    variants = {k: (v, args.straggler_steps) for k, v in STRAGGLER.items()} | {
        k: (v, args.steps) for k, v in SYNC.items()
    }
    results = {}
    with tempfile.TemporaryDirectory(prefix="etrain-bench-comm-") as root:
        for name, (overrides, steps) in variants.items():
            if args.only and name not in args.only:
                continue
            started = time.perf_counter()
            results[name] = run_variant(name, overrides, steps, Path(root), args.data)
            print(
                f"{name:>9}: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results[name].items()})} "  # noqa: E501
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    report = {
        "machine": "2 cores, tiny GPT (2 layers, 128 wide), 2 workers, gloo",
        "variants": results,
        "ratios": compare(results),
    }
    return publish(report, "ratios", args.out)


if __name__ == "__main__":
    main()
