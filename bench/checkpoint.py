"""Checkpoints, side by side in one run: a ~25 M-parameter GPT (a ~300 MB full checkpoint), 2 workers.

1. Stall per save, synchronous (`checkpoint.async_save=false`: the step waits for the
   whole write) vs asynchronous (the step waits while the state is copied to CPU; the
   write goes on in the background), and each run's wall time, since the background
   write shares the CPU with training.
2. Bytes of a light save (changed weights in bf16) vs a full one (weights, optimizer,
   scheduler, scaler).
3. Time to resume: from a full checkpoint, and from a light one with its base.

    python bench/checkpoint.py [--steps 16] [--every 4] [--uri DIR_OR_S3_URI]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import ray

from etrain.control.control import JobError
from etrain.core.config import load_config
from etrain.core.records import read_jsonl
from etrain.driver.job import new_run_dir, train

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = [
    "model.n_layer=8",
    "model.n_head=8",
    "model.d_model=512",
    "model.seq_len=64",
    "train.global_batch=2",
    "train.micro_batch=1",
]


def config(name: str, root: Path, data_dir: str, uri: str | None, steps: int, *overrides: str):
    base = [
        f"data.cache_dir={data_dir}",
        f"run.root={root}",
        f"run.name={name}",
        f"train.steps={steps}",
        "train.eval_every=0",
        "cluster.warm_pool=0",
        "cluster.max_recoveries=0",
        "balance.enabled=false",
    ]
    if uri:
        base.append(f"checkpoint.uri={uri.rstrip('/')}/{name}")
    return load_config("tiny", [*base, *MODEL, *overrides])


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == kind]


def run(
    name: str, root: Path, data_dir: str, uri: str | None, steps: int, *overrides: str, crash: bool = False
) -> Path:
    cfg = config(name, root, data_dir, uri, steps, *overrides)
    run_dir = new_run_dir(cfg)
    started = time.perf_counter()
    try:
        train(cfg, run_dir, progress=False)
    except JobError:
        if not crash:
            raise
    print(f"{name:>7}: {time.perf_counter() - started:.1f} s", flush=True)
    return run_dir


def saving(run_dir: Path) -> dict:
    saves = records(run_dir, "checkpoint")
    steps = records(run_dir, "train")
    return {
        "saves": len(saves),
        "stall_s": [round(s["stall_s"], 4) for s in saves],
        "mean_stall_s": statistics.mean(s["stall_s"] for s in saves),
        "mean_save_s": statistics.mean(s["save_s"] for s in saves),
        "full_bytes": [s["bytes"] for s in saves if s["level"] == "full"][-1],
        "wall_s": steps[-1]["time"] - steps[0]["time"],
        "mean_step_s": statistics.mean(s["step_time_s"] for s in steps[1:]),
    }


def resume(run_dir: Path, root: Path, data_dir: str, uri: str | None, steps: int, *overrides: str) -> dict:
    cfg = config(run_dir.name, root, data_dir, uri, steps, *overrides)
    train(cfg, run_dir, resume=True, progress=False)
    event = records(run_dir, "resume")[-1]
    return {"load_s": event["load_s"], "level": event["level"], "from_step": event["step"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument(
        "--every", type=int, default=4, help="steps between full saves (light saves: every step in between)"
    )
    parser.add_argument("--uri", help="where checkpoints go (default: each run's directory on local disk)")
    parser.add_argument("--model", nargs="*", default=None, help="model overrides (default: the ~25 M GPT)")
    parser.add_argument(
        "--data", default=str(Path.home() / ".cache/etrain/data"), help="where the embedded corpus is built"
    )
    parser.add_argument("--out", default=str(RESULTS / "checkpoint.json"), help="results file ('' to skip)")
    args = parser.parse_args(argv)
    if args.model is not None:
        MODEL[:] = args.model
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    n, every = args.steps, args.every
    with tempfile.TemporaryDirectory(prefix="etrain-bench-checkpoint-") as tmp:
        root = Path(tmp)
        common = (root, args.data, args.uri)
        sync = run("sync", *common, n, f"checkpoint.every={every}", "checkpoint.async_save=false")
        asyn = run("async", *common, n, f"checkpoint.every={every}", "checkpoint.async_save=true")
        # Light saves between full ones; a worker killed in the last step leaves a light checkpoint the newest.
        light = run(
            "light",
            *common,
            n,
            f"checkpoint.every={every * 2}",
            "checkpoint.light_every=1",
            f"faults=[{{kind: kill, step: {n}, rank: 1}}]",
            crash=True,
        )
        saves = records(light, "checkpoint")
        results = {
            "sync": saving(sync),
            "async": saving(asyn),
            "light_bytes": statistics.mean(s["bytes"] for s in saves if s["level"] == "light"),
            "full_bytes": statistics.mean(s["bytes"] for s in saves if s["level"] == "full"),
            "resume_full": resume(asyn, *common, n + 1, f"checkpoint.every={every}"),
            "resume_light": resume(light, *common, n, f"checkpoint.every={every * 2}", "checkpoint.light_every=1"),
        }
    ratios = {
        "async_vs_sync_stall": results["async"]["mean_stall_s"] / results["sync"]["mean_stall_s"],
        "async_vs_sync_wall": results["async"]["wall_s"] / results["sync"]["wall_s"],
        "light_vs_full_bytes": results["light_bytes"] / results["full_bytes"],
        "resume_light_vs_full_time": results["resume_light"]["load_s"] / results["resume_full"]["load_s"],
    }
    report = {
        "machine": "2 cores, GPT 8 x 512 (~25 M parameters), 2 workers, gloo",
        "storage": args.uri or "local disk",
        "model": MODEL,
        "results": results,
        "ratios": ratios,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
