"""Goodput under frequent failures, ours vs Ray Train v2: a random worker killed every K steps (K = 5, 20, 100).

TorchFT's published figure is the model: 82.3% of steps committed with a failure every 60 s and ~11 s steps (one
per ~5.5 steps), on 300 L40S GPUs. Here both train the tiny GPT with 2 workers on the same samples, for --steps
steps of --batch samples; at steps K, 2K, 3K, ... a worker drawn from --seed dies (os._exit, as a crash or an OOM
kill does). Ours replaces it from the warm pool (cluster.warm_pool=1, refilled in the background), copies the state
from a live peer and redoes the one step; a kill waits for a ready pool worker (`ready_pool`: at K = 5 a pool
worker, ~3 s to start here, is not always back in time, and a kill of the one worker left would end the run, not
measure it), so each kill is taken at the first step from its own where a replacement is ready. Ray Train
(TorchTrainer, FailureConfig(max_failures) for every kill, a checkpoint every --ckpt-every steps) restarts its
worker group from its last checkpoint. An unfaulted run of each is the baseline. Measured per run:

- committed_share: steps committed / steps attempted (a failed or redone step is attempted, not committed);
- tokens_per_s: tokens of the committed steps over the training time (first step to last; start-up is apart);
- goodput: tokens_per_s over the unfaulted run's of the same trainer (the round's own baseline);
- every_sample_once (ours): each step recorded once and the data cursor exact;
- badput by cause (ours, etrain/core/goodput.py `time_split` of the run's records): start-up, detection,
  re-forming, redone steps, unaccounted; and the refill measured apart: the kept steps' time beyond as many steps
  of the round's unfaulted run (its median step). Nothing else differs between the two runs' steps, so that excess
  is what the pool's workers starting beside the survivors cost them.

Each variant runs in a fresh process, --rounds times interleaved; bench/results/chaos.json has the medians with
their spread. CPU figures: a step here is ~0.1-0.3 s, so the fixed costs of a recovery (detection, re-forming the
group, the first step's warm-up) weigh far more per failure than on GPU steps of seconds.

    python bench/chaos.py [--steps 100] [--every 5 20 100] [--rounds 3] [--only ours-K20 ...] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from rounds import in_own_process, interleaved, publish, summary

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def schedule(args, every: int) -> list[tuple[int, int]]:
    """(step, rank) of each kill: every `every` steps, a rank drawn from the seed."""
    rng = random.Random(args.seed * 1000 + every)
    return [(step, rng.randrange(2)) for step in range(every, args.steps + 1, every)] if every else []


def overrides(args) -> list[str]:
    return [
        f"train.steps={args.steps}",
        f"train.global_batch={args.batch}",
        "train.micro_batch=8",
        "train.eval_every=0",
        "train.deterministic=true",
        "checkpoint.every=0",
        "cluster.num_workers=2",
        "cluster.cpus_per_worker=1",
        f"data.cache_dir={args.data}",
    ]


# -- ours -----------------------------------------------------------------------


def run_ours(args, every: int, extra: tuple[str, ...] = (), ready_pool: bool = True) -> dict:
    """`ready_pool`: each kill waits for a replacement (the bench); without, the group shrinks (the bench's test)."""
    from etrain.core.config import load_config
    from etrain.core.goodput import time_split
    from etrain.core.records import read_jsonl
    from etrain.driver.job import new_run_dir, train

    wait = ", ready_pool: true" if ready_pool else ""
    kills = ", ".join(f"{{rank: {r}, step: {s}, kind: kill{wait}}}" for s, r in schedule(args, every))
    sets = [f"faults=[{kills}]", "cluster.warm_pool=1", f"cluster.max_recoveries={args.steps}", *extra]
    cfg = load_config("tiny", [*overrides(args), *sets, f"run.root={tempfile.mkdtemp(prefix='chaos-ours-')}"])
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if r["kind"] == "train"]
    failures = sum(r["kind"] == "membership" and r["reason"] == "recover" for r in records)
    redone = failures - sum(r.get("loss") is None for r in steps)  # the survivors committed a step they all finished
    once = [r["step"] for r in steps] == list(range(1, args.steps + 1)) and all(
        r["cursor"] == r["step"] * cfg.train.global_batch for r in steps
    )
    split = time_split(records)
    return {
        "committed_share": len(steps) / (len(steps) + redone),
        "tokens_per_s": tokens_per_s(args, [r["time"] for r in steps], steps[0].get("step_time_s") or 0),
        "failures": failures,
        "kills": sum(r["kind"] == "fault" for r in records),  # fired: a kill late in the run may wait past its end
        "worlds": sorted({r["world_size"] for r in steps}),
        "every_sample_once": once,
        "productive_s": split["productive_s"],
        **{f"{cause}_s": seconds for cause, seconds in split["badput_s"].items()},
        "step_s": statistics.median(r["step_time_s"] for r in steps if r.get("step_time_s") is not None),
        "kept_steps": sum(r.get("step_time_s") is not None for r in steps),
    }


def tokens_per_s(args, times: list[float], first_step_s: float) -> float:
    """Tokens of the committed steps over the training time: the first step's start to the last step's end."""
    from etrain.core.config import load_config

    seq = load_config("tiny").model.seq_len
    return args.steps * args.batch * seq / (times[-1] - times[0] + first_step_s)


# -- Ray Train ------------------------------------------------------------------


def ray_train_loop(config: dict) -> None:
    """Ray Train's documented pattern (bench/elastic.py's loop), with a kill at each scheduled step, once."""
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
    log, kills = Path(config["log"]), {step: r for step, r in config["kills"]}
    for step in range(start, cfg.train.steps):
        mark = Path(config["work"]) / f"killed-{step + 1}"
        if kills.get(step + 1) == rank and not mark.exists():
            mark.write_text(str(time.time()))
            os._exit(1)
        ray_train_step(model, optimizer, scheduler, reader, layout, cfg, step, rank, world)
        if rank == 0:
            with log.open("a") as f:
                f.write(json.dumps({"step": step + 1, "time": time.time()}) + "\n")
        if (step + 1) % config["ckpt_every"] == 0 or step + 1 == cfg.train.steps:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    inner = model.module if hasattr(model, "module") else model
                    state = {"model": inner.state_dict(), "optimizer": optimizer.state_dict()}
                    state |= {"scheduler": scheduler.state_dict(), "step": step + 1}
                    torch.save(state, Path(d) / "state.pt")
                ray.train.report(
                    {"step": step + 1}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None
                )


def run_ray_train(args, every: int) -> dict:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from etrain.core.config import load_config
    from etrain.data.embedded import ensure_corpus

    cfg = load_config("tiny", overrides(args))
    manifest = ensure_corpus(cfg)
    ray.init(address="local", num_cpus=3, logging_level="warning")
    work = Path(tempfile.mkdtemp(prefix="chaos-raytrain-"))
    kills = schedule(args, every)
    config = {"cfg": cfg.model_dump(), "manifest": manifest, "log": str(work / "steps.jsonl"), "work": str(work)}
    config |= {"kills": kills, "ckpt_every": args.ckpt_every}
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            storage_path=str(work / "storage"), name="bench", failure_config=FailureConfig(max_failures=len(kills))
        ),
    )
    trainer.fit()
    steps = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines()]
    # from the first completion of step 1 (a restart from scratch redoes it: its cost counts) to the last step's end
    times = [s["time"] for s in steps]
    first = next(i for i, s in enumerate(steps) if s["step"] == 2)
    return {
        "committed_share": args.steps / (len(steps) + len(kills)),
        "tokens_per_s": tokens_per_s(args, [times[0], times[-1]], times[first] - times[0]),
        "failures": len(kills),
        "kills": sum(1 for _ in work.glob("killed-*")),
    }


# -- the bench -------------------------------------------------------------------


def variants(everies: list[int]) -> list[str]:
    return [f"{who}-K{k}" for k in [0, *everies] for who in ("ours", "raytrain")]


def run_variant(args, variant: str) -> dict:
    who, k = variant.split("-K")
    return run_ours(args, int(k), tuple(args.set)) if who == "ours" else run_ray_train(args, int(k))


def measure(args, variant: str) -> dict:
    launched = time.time()
    result = in_own_process(__file__, ["--variant", variant, *forward(args)], variant)
    return {"variant": variant, **result, "wall_s": time.time() - launched}


def forward(args) -> list[str]:
    out = ["--steps", str(args.steps), "--batch", str(args.batch), "--seed", str(args.seed)]
    return out + ["--ckpt-every", str(args.ckpt_every), "--data", args.data, "--set", *args.set]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=64, help="samples per step (of 128 tokens)")
    p.add_argument("--every", type=int, nargs="+", default=[5, 20, 100], help="K: a worker killed every K steps")
    p.add_argument("--seed", type=int, default=0, help="draws which worker each kill takes")
    p.add_argument("--ckpt-every", type=int, default=5, help="Ray Train's checkpoint interval (steps)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", nargs="+", help="variants to run (ours-K20, raytrain-K0, ...)")
    p.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "etrain-bench-data"))
    p.add_argument("--out", default=str(RESULTS / "chaos.json"), help="'' to write nothing")
    p.add_argument("--set", nargs="*", default=[], help="config overrides for our runs (an A/B of a setting)")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args, args.variant)))
        return
    chosen = args.only or variants(args.every)
    runs = interleaved(
        args.rounds,
        chosen,
        lambda v: measure(args, v),
        lambda v, r: (
            f"{v:14s} committed {r['committed_share']:.3f}  tokens/s {r['tokens_per_s']:8.0f}  run {r['wall_s']:5.1f} s"
        ),
    )
    for rs in runs.values():  # each run's goodput against its own round's unfaulted run of the same trainer
        for i, r in enumerate(rs):
            who = r["variant"].split("-K")[0]
            base = runs.get(f"{who}-K0")
            if base:
                r["goodput"] = r["tokens_per_s"] / base[i]["tokens_per_s"]
    for rs in runs.values():
        for i, r in enumerate(rs):
            base = runs.get("ours-K0")
            if r["variant"].startswith("ours-") and base and "productive_s" in r:
                r["refill_s"] = r["productive_s"] - r["kept_steps"] * base[i]["step_s"]
    rows = {v: summary(rs) for v, rs in runs.items()}
    shown = {
        v: {k: rows[v][k]["median"] for k in ("committed_share", "goodput") if k in rows[v]}
        | {f"{k}_spread": [rows[v][k]["min"], rows[v][k]["max"]] for k in ("goodput",) if k in rows[v]}
        for v in rows
    }
    causes = ("start_up", "detection", "re_forming", "redone_steps", "refill", "unaccounted")
    split = {
        v: {c: round(rows[v][f"{c}_s"]["median"], 2) for c in causes if f"{c}_s" in rows[v]}
        | {"failures": rows[v]["failures"]["median"]}
        for v in rows
        if v.startswith("ours-")
    }
    print("badput by cause (s, medians):\n" + json.dumps(split, indent=1))
    report = {"args": vars(args), "goodput": shown, "badput_s": split, "rows": rows, "runs": runs}
    report["when"] = time.strftime("%Y-%m-%d %H:%M")
    publish(report, "goodput", args.out)


if __name__ == "__main__":
    main()
