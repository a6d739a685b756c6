"""Training over slow links: time to the dense run's loss, side by side in one run.

The tiny GPT, 2 workers, one local Ray instance. Each gradient-sync mode (dense all-reduce, bf16, top-k and
PowerSGD with their default dense warm-up, DiLoCo at two values of H) trains the same samples under each simulated
link (fault kind link, etrain/worker/link.py: each collective lasts what a ring over that link would need for the
bytes it really sends) and with none. Dense trains --steps, each other mode 1.5x as many (a schedule that long), so
that it can reach dense's loss. Per variant:

- the wall time from the first step to the first evaluation at or below the dense run's final eval loss under the
  same link (`time_to_dense_loss_s`; None: not reached), and its ratio to dense's own time (`vs_dense_time`)
- the eval loss at dense's last step (equal samples), against dense's (`eval_loss_vs_dense`); the other modes' lr
  is still higher there than dense's at its end, which this figure holds against them
- the bytes each worker handed to collectives per sample (`bytes_per_sample`)

This machine computes ~10^4 times slower than a GPU, so the link that puts it where a GPU cluster on 1 Gbit/s
Ethernet is (communication most of the step) is far slower than 1 Gbit/s: the default links add 0.1 Gbit/s.

    python bench/lowband.py [--rounds 3] [--steps 160] [--links none 10 1 0.1] [--only MODE ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

import ray
from rounds import interleaved, publish, summary

from etrain.core.config import load_config
from etrain.core.records import read_jsonl
from etrain.driver.job import new_run_dir, train

RESULTS = Path(__file__).resolve().parent / "results"
AVERAGING = ["comm.diloco.outer_lr=1.0", "comm.diloco.outer_momentum=0"]
MODES = {
    "dense": [],
    "bf16": ["comm.compression=bf16"],
    "topk": ["comm.compression=topk"],
    "powersgd": ["comm.compression=powersgd"],
    # the outer step as plain averaging: on this model and run length the paper's Nesterov (0.7, 0.9) costs far more
    # loss (bench/experiments/diloco_outer.md)
    "diloco4": ["comm.mode=diloco", "comm.diloco.inner_steps=4", *AVERAGING],
    "diloco16": ["comm.mode=diloco", "comm.diloco.inner_steps=16", *AVERAGING],
}
EVAL_EVERY = 16  # a multiple of every H above: each mode is evaluated at the same steps
LONGER = 1.5  # the other modes may run this many times dense's steps to reach its loss


def link_fault(gbps: str) -> list[str]:
    return [] if gbps == "none" else [f"faults=[{{kind: link, rank: 0, step: 1, gbps: {gbps}, latency_ms: 0.5}}]"]


def run_variant(mode: str, gbps: str, steps: int, root: Path, data_dir: str, round_: int = 0) -> dict:
    cfg = load_config(
        "tiny",
        [
            f"data.cache_dir={data_dir}",
            f"run.root={root}",
            f"run.name={mode}-{gbps}-{round_}",
            f"train.steps={steps}",
            f"train.eval_every={EVAL_EVERY}",
            "checkpoint.every=0",
            "cluster.warm_pool=0",
            "balance.enabled=false",  # the same shares in every variant: the same samples per worker
            *MODES[mode],
            *link_fault(gbps),
        ],
    )
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps_ = [r for r in records if r["kind"] == "train"]
    began = steps_[0]["time"] - steps_[0]["step_time_s"]
    world = steps_[-1]["world_size"]
    return {
        "wall_s": steps_[-1]["time"] - began,
        "evals": [(r["step"], r["time"] - began, r["eval_loss"]) for r in records if r["kind"] == "eval"],
        "bytes_per_sample": sum(r["comm_bytes"] for r in steps_) / world / steps_[-1]["cursor"],
        "communication_share": sum(r["communication_s"] for r in steps_) / sum(r["step_time_s"] for r in steps_),
    }


def against_dense(result: dict, dense: dict) -> dict:
    """Time to dense's final eval loss (under the same link), and the eval loss at dense's last step (equal samples),
    against dense's."""
    last, target = dense["evals"][-1][0], dense["evals"][-1][2]
    reached = next((t for _, t, loss in result["evals"] if loss <= target), None)
    own = next(t for _, t, loss in dense["evals"] if loss <= target)
    equal = next(loss for step, _, loss in result["evals"] if step == last)
    return {
        "time_to_dense_loss_s": reached,
        "vs_dense_time": reached / own if reached is not None else None,
        "eval_loss": equal,
        "eval_loss_vs_dense": equal / target - 1,
        "bytes_per_sample": result["bytes_per_sample"],
        "communication_share": result["communication_share"],
        "wall_s": result["wall_s"],
    }


def spread(rounds: list[dict]) -> dict:
    """Each figure's median, min and max over the rounds where it exists (a time to a loss never reached does not),
    and in how many rounds it does."""
    out = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds if r[key] is not None]
        out[key] = summary([{key: v} for v in values])[key] | {"rounds": len(values)} if values else None
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=160, help="dense's steps (a multiple of 32)")
    parser.add_argument("--links", nargs="+", default=["none", "10", "1", "0.1"], help="Gbit/s, or none")
    parser.add_argument("--only", nargs="*", choices=list(MODES), help="these modes (dense always runs)")
    parser.add_argument("--data", default=str(Path.home() / ".cache/etrain/data"))
    parser.add_argument("--out", default=str(RESULTS / "lowband.json"), help="results file ('' to skip)")
    args = parser.parse_args(argv)
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    modes = ["dense", *[m for m in MODES if m != "dense" and (not args.only or m in args.only)]]
    variants = [f"{m}@{g}" for g in args.links for m in modes]
    steps = int(LONGER * args.steps)
    with tempfile.TemporaryDirectory(prefix="etrain-bench-lowband-") as root:
        done = Counter()

        def measure(variant: str) -> dict:
            mode, gbps = variant.split("@")
            done[variant] += 1
            length = args.steps if mode == "dense" else steps
            return run_variant(mode, gbps, length, Path(root), args.data, done[variant])

        def line(variant: str, r: dict) -> str:
            share, loss = r["communication_share"], r["evals"][-1][2]
            return f"{variant:<16} wall {r['wall_s']:6.1f} s  eval {loss:.4f}  communication {share:.0%}"

        started = time.perf_counter()
        runs = interleaved(args.rounds, variants, measure, line)
    per_round = {
        v: [against_dense(r, runs[f"dense@{v.split('@')[1]}"][i]) for i, r in enumerate(rs)] for v, rs in runs.items()
    }
    figures = {v: spread(rs) for v, rs in per_round.items()}
    report = {
        "what": "tiny GPT, 2 workers, each gradient-sync mode under each simulated link (fault kind link) and none; "
        f"dense trains --steps, the others {LONGER}x as many (their schedules that long); time to the dense run's "
        "final eval loss under the same link, eval loss at dense's last step (equal samples: the others' lr is "
        "higher there than dense's), bytes per sample",
        "command": "python bench/lowband.py " + " ".join(argv or []),
        "steps": args.steps,
        "rounds": args.rounds,
        "seconds": time.perf_counter() - started,
        "figures": figures,
        "runs": {v: rs for v, rs in runs.items()},
    }
    return publish(report, "figures", args.out)


if __name__ == "__main__":
    main()
