"""Membership changes side by side, Ray Train v2 vs ours: a worker lost mid-run, and a node added.

Both train the tiny GPT with 2 workers on the same samples; at step --kill-at
worker rank 1 dies (os._exit, as a crash or an OOM kill does). Ray Train
(TorchTrainer, FailureConfig(max_failures=1), a checkpoint every --ckpt-every
steps) restarts its worker group and resumes from the checkpoint; ours replaces
the worker from the warm pool, copies state from a live peer and redoes the one
failed step. Each variant runs in its own fresh process. Measured per variant:

- recovery_s: from the failure until the step that failed is completed (Ray
  Train first redoes the steps since its checkpoint),
- steps_redone: steps computed twice,
- wall_s: the whole run, launch to exit.

ours-shard: the same loss where no live peer holds the lost rank's state, one replica of parallel.shard=2
(FSDP2): like Ray Train it goes back to its newest checkpoint (DCP, every --ckpt-every steps) and redoes the
steps since, re-formed with the pool worker (issue 29, item 4).

A node added: the job starts with one worker on a 1-CPU head; once it trains,
a 2-CPU node joins (ray.cluster_utils.Cluster: a second raylet on this
machine). Ray Train v2 runs elastic (ScalingConfig(num_workers=(1, 2)), its
default resize interval) and restarts its group at the new size from the last
checkpoint; ours (cluster.max_workers=2, warm pool 1) lets the pool worker
that started on the new node join. Measured: scale_out_s, from the node's
arrival to the first step trained by 2 workers.

Each variant runs --rounds times (3), interleaved; the table, the ratios and
bench/results/elastic.json give medians with their spread.

    python bench/elastic.py [--steps 150] [--kill-at 90] [--ckpt-every 25] [--rounds 3] [--only ours-shard ...]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from rounds import in_own_process, interleaved, summary

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def overrides(args) -> list[str]:
    return [
        f"train.steps={args.steps}",
        "train.eval_every=0",
        "checkpoint.every=0",
        "cluster.num_workers=2",
        "cluster.cpus_per_worker=1",
        f"data.cache_dir={args.data}",
    ]


# -- Ray Train ------------------------------------------------------------------


def ray_train_loop(config: dict) -> None:
    """Ray Train's documented pattern: resume from ray.train.get_checkpoint(), report a checkpoint every N steps."""
    import ray.train
    import ray.train.torch
    import torch

    from bench.throughput import ray_train_step
    from etrain.core.config import Config
    from etrain.core.models.gpt.model import GPT
    from etrain.core.optim import make_optimizer, make_scheduler
    from etrain.data import order
    from etrain.data.shards import ShardReader, read_manifest

    cfg = Config.model_validate(config["cfg"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(1)
    reader = ShardReader(config["manifest"], "train")
    sizes = tuple(s["samples"] for s in read_manifest(config["manifest"])["splits"]["train"]["shards"])
    layout = order.Layout(cfg.train.seed, sizes, cfg.data.shuffle_shards)
    torch.manual_seed(cfg.train.seed)
    model = ray.train.torch.prepare_model(GPT(cfg.model))
    optimizer = make_optimizer(model, cfg.optim)
    scheduler = make_scheduler(optimizer, cfg.optim, cfg.train.steps)
    start = 0
    if checkpoint := ray.train.get_checkpoint():
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=True)
        (model.module if hasattr(model, "module") else model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = state["step"]
    log = Path(config["log"])
    for step in range(start, cfg.train.steps):
        if step + 1 == config["kill_at"] and rank == 1 and not Path(config["killed"]).exists():
            Path(config["killed"]).write_text(str(time.time()))
            os._exit(1)
        ray_train_step(model, optimizer, scheduler, reader, layout, cfg, step, rank, world)
        if rank == 0:
            with log.open("a") as f:
                f.write(json.dumps({"step": step + 1, "time": time.time(), "world": world}) + "\n")
        if (step + 1) % config["ckpt_every"] == 0:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    inner = model.module if hasattr(model, "module") else model
                    torch.save(
                        {
                            "model": inner.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(),
                            "step": step + 1,
                        },
                        Path(d) / "state.pt",
                    )
                ray.train.report(
                    {"step": step + 1}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None
                )


def run_ray_train(args) -> dict:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from etrain.core.config import load_config
    from etrain.data.embedded import ensure_corpus

    cfg = load_config("tiny", overrides(args))
    manifest = ensure_corpus(cfg)
    ray.init(address="local", num_cpus=3, logging_level="warning")
    work = Path(tempfile.mkdtemp(prefix="raytrain-"))
    config = {
        "cfg": cfg.model_dump(),
        "manifest": manifest,
        "log": str(work / "steps.jsonl"),
        "killed": str(work / "killed"),
        "kill_at": args.kill_at,
        "ckpt_every": args.ckpt_every,
    }
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            storage_path=str(work / "storage"), name="bench", failure_config=FailureConfig(max_failures=1)
        ),
    )
    trainer.fit()
    steps = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines()]
    killed = float((work / "killed").read_text())
    after = [s for s in steps if s["time"] > killed]
    back = next(s for s in after if s["step"] == args.kill_at)
    return {
        "recovery_s": back["time"] - killed,
        "steps_redone": len(steps) - args.steps,
        "steps": len({s["step"] for s in steps}),
    }


# -- ours -----------------------------------------------------------------------


def train_ours_losing_rank_1(args, *sets: str) -> Path:
    """Our run of the tiny GPT (warm pool 1) in which rank 1 dies at step --kill-at; its run directory."""
    from etrain.core.config import load_config
    from etrain.driver.job import new_run_dir, train

    fault = f"faults=[{{rank: 1, step: {args.kill_at}, kind: kill}}]"
    root = f"run.root={tempfile.mkdtemp(prefix='ours-')}"
    cfg = load_config("tiny", [*overrides(args), "cluster.warm_pool=1", fault, *sets, root])
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    return run_dir


def run_ours(args) -> dict:
    from etrain.core.records import read_jsonl

    records = read_jsonl(train_ours_losing_rank_1(args) / "metrics.jsonl")
    recover = next(r for r in records if r["kind"] == "membership" and r["reason"] == "recover")
    steps = [r for r in records if r["kind"] == "train"]
    failed = next(r for r in steps if r["step"] == recover["step"] + 1)
    # "detect" starts at the failed step's dispatch, where the worker died; total_s runs until that step is
    # committed by the new group. A step the survivors had finished is committed without a loss, not redone.
    return {
        "recovery_s": recover["total_s"],
        "steps_redone": int(failed.get("loss") is not None),
        "steps": len(steps),
        "phases": recover["phases"],
        "joiners_from_pool": recover["joiners"],
        "world_after": recover["world_after"],
    }


def run_ours_shard(args) -> dict:
    """One replica of shard=2 (FSDP2) loses a rank: no live replica holds its shards, so the run goes back to its
    newest checkpoint (DCP, every --ckpt-every steps as Ray Train's), re-forms with the pool worker and redoes the
    steps since. Measured as Ray Train is: from the failure until the failed step is completed again."""
    from etrain.core.records import read_jsonl

    run_dir = train_ours_losing_rank_1(args, "parallel.shard=2", f"checkpoint.every={args.ckpt_every}")
    records, set_aside = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "metrics.redone.jsonl")
    fired = next(r for r in set_aside if r["kind"] == "fault")  # recorded in the steps the rollback set aside
    back = next(r for r in records if r["kind"] == "train" and r["step"] == args.kill_at)
    rollback = next(r for r in records if r["kind"] == "rollback")
    recover = next(r for r in records if r["kind"] == "membership" and r["reason"] == "recover")
    return {
        "recovery_s": back["time"] - fired["time"],
        "steps_redone": len([r for r in set_aside if r["kind"] == "train"]),
        "steps": len([r for r in records if r["kind"] == "train"]),
        "back_to_step": rollback["step"],
        "reform_s": recover["total_s"],
        "phases": recover["phases"],
    }


# -- a node added: Ray Train v2 elastic (num_workers=(1, 2)) vs our autoscaling -----


def grow(args, start, world_of, phases_of=None) -> dict:
    """A 1-CPU head runs the job's first worker; once it trains, a 2-CPU node joins the cluster.
    Returns the seconds from the node's arrival to the first step trained by 2 workers, and with `phases_of`, those
    seconds in phases."""
    import threading

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    thread = threading.Thread(target=start, args=(cluster.address,), daemon=True)
    thread.start()
    wait(lambda: world_of(1), 300, "the first step")
    cluster.add_node(num_cpus=2)
    added = time.time()
    grown = wait(lambda: world_of(2), args.grow_timeout, "a step at 2 workers")
    phases = wait(lambda: phases_of(added), 30, "the scale-out's record") if phases_of else None
    print(json.dumps({"scale_out_s": grown - added} | {f"{k}_s": v for k, v in (phases or {}).items()}), flush=True)
    # The run is left mid-training: the process group's kill (rounds.in_own_process) ends it and the cluster's
    # processes. Not cluster.shutdown(): the run's thread, still calling Ray, makes Ray exit this process with 1.
    # The head's address file goes now: left behind, the next ray.init() here would try to join a dead cluster.
    current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    if current.exists() and current.read_text().strip() == cluster.address:
        current.unlink()
    os._exit(0)


def wait(probe, timeout: float, what: str) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (when := probe()) is not None:
            return when
        time.sleep(0.1)
    raise SystemExit(f"no {what} within {timeout} s")


def run_ray_train_grow(args) -> dict:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from etrain.core.config import load_config
    from etrain.data.embedded import ensure_corpus

    cfg = load_config("tiny", [*overrides(args), "train.steps=100000"])
    work = Path(tempfile.mkdtemp(prefix="raytrain-"))
    log = work / "steps.jsonl"
    config = {
        "cfg": cfg.model_dump(),
        "manifest": ensure_corpus(cfg),
        "log": str(log),
        "killed": str(work / "killed"),
        "kill_at": 0,
        "ckpt_every": args.ckpt_every,
    }

    def start(address: str) -> None:
        ray.init(address=address, logging_level="warning")
        TorchTrainer(
            ray_train_loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=(1, 2), use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=str(work / "storage"), name="bench"),
        ).fit()

    def world_of(n: int) -> float | None:
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return next((r["time"] for r in rows if r["world"] == n), None)

    return grow(args, start, world_of)


def run_ours_grow(args) -> dict:
    import ray

    from etrain.core.config import load_config
    from etrain.core.records import read_jsonl
    from etrain.driver.job import new_run_dir, train

    cfg = load_config(
        "tiny",
        [
            *overrides(args),
            "train.steps=100000",
            "cluster.num_workers=1",
            "cluster.max_workers=2",
            "cluster.warm_pool=1",
            f"run.root={tempfile.mkdtemp(prefix='ours-')}",
        ],
    )
    run_dir = new_run_dir(cfg)

    def start(address: str) -> None:
        ray.init(address=address, namespace="etrain", logging_level="warning")
        train(cfg, run_dir, progress=False)

    def world_of(n: int) -> float | None:
        path = run_dir / "metrics.jsonl"
        rows = read_jsonl(path) if path.exists() else []
        return next((r["time"] for r in rows if r["kind"] == "train" and r["world_size"] == n), None)

    def phases_of(added: float) -> dict | None:
        """The scale-out's membership record as phases from the node's arrival (JOIN_PHASES, then CHANGE_PHASES)."""
        rows = read_jsonl(run_dir / "metrics.jsonl")
        change = next((r for r in rows if r["kind"] == "membership" and r["reason"] == "scale-out"), None)
        if change is None or "first_step" not in change["phases"]:
            return None
        return {"node": change["joined_at"] - added} | change["joined"] | change["phases"]

    return grow(args, start, world_of, phases_of)


VARIANTS = {
    "raytrain": run_ray_train,
    "ours": run_ours,
    "ours-shard": run_ours_shard,
    "raytrain-grow": run_ray_train_grow,
    "ours-grow": run_ours_grow,
}


def measure(args, variant: str) -> dict:
    launched = time.time()  # a variant that leaves mid-run (the node-added ones) leaves Ray processes behind
    result = in_own_process(__file__, ["--variant", variant, *forward(args)], variant)
    return {"variant": variant, **result, "wall_s": time.time() - launched}


def forward(args) -> list[str]:
    return [
        "--steps",
        str(args.steps),
        "--kill-at",
        str(args.kill_at),
        "--ckpt-every",
        str(args.ckpt_every),
        "--grow-timeout",
        str(args.grow_timeout),
        "--data",
        args.data,
    ]


METRIC = {
    "raytrain": "recovery_s",
    "ours": "recovery_s",
    "ours-shard": "recovery_s",
    "raytrain-grow": "scale_out_s",
    "ours-grow": "scale_out_s",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--kill-at", type=int, default=90, help="1-based step at which rank 1 dies")
    p.add_argument("--ckpt-every", type=int, default=25, help="Ray Train's checkpoint interval (steps)")
    p.add_argument(
        "--grow-timeout", type=float, default=240, help="longest wait for a step at 2 workers after the node"
    )
    p.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "etrain-bench-data"))
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of every variant; the figures are their medians"
    )
    p.add_argument("--only", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="variants to run")
    p.add_argument("--variant", choices=VARIANTS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(VARIANTS[args.variant](args)))
        return
    runs = interleaved(
        args.rounds,
        args.only,
        lambda variant: measure(args, variant),
        lambda v, r: f"{v:13s} {METRIC[v]} {r[METRIC[v]]:6.2f} s   run {r['wall_s']:6.1f} s",
    )
    rows = {v: summary(rs) for v, rs in runs.items()}
    ratios = {}
    for name, ours, theirs, key in (
        ("ours_vs_raytrain_recovery_s", "ours", "raytrain", "recovery_s"),
        ("ours_vs_raytrain_wall_s", "ours", "raytrain", "wall_s"),
        ("ours_shard_vs_raytrain_recovery_s", "ours-shard", "raytrain", "recovery_s"),
        ("ours_shard_vs_raytrain_steps_redone", "ours-shard", "raytrain", "steps_redone"),
        ("ours_vs_raytrain_scale_out_s", "ours-grow", "raytrain-grow", "scale_out_s"),
    ):
        if ours in rows and theirs in rows:
            ratios[name] = rows[ours][key]["median"] / rows[theirs][key]["median"]
    for variant, row in rows.items():
        figure = row[METRIC[variant]]
        print(
            f"{variant:13s} {METRIC[variant]:12s} median {figure['median']:6.2f} s  (spread "
            f"{figure['min']:.2f}-{figure['max']:.2f})"
        )
    for name, value in ratios.items():
        print(f"{name:32s} {value:6.3f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "elastic.json"
    out.write_text(
        json.dumps(
            {"args": vars(args), "rows": rows, "runs": runs, "ratios": ratios, "when": time.strftime("%Y-%m-%d %H:%M")},
            indent=1,
        )
    )
    print(f"written: {out}")


if __name__ == "__main__":
    main()
