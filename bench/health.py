"""Predictive maintenance side by side: the same failing (or merely noisy) node, handled reactively (health.action
observe: the job learns of the failure when the worker dies, and redoes the step) and predictively (health.action
drain: the node is drained at a step boundary once its risk reaches health.drain_at).

Each run has three 1-CPU nodes (ray.cluster_utils.Cluster: raylets on this machine): two members and one warm
pool worker, one per node. The tiny GPT, 2 workers, `--steps` steps. Scenarios:

- degrade: rank 1's compute slows by `--growth` more each step from `--onset`, and it dies at `--until`;
- ecc: rank 1's node reports single-bit ECC errors at a rising rate from `--onset` (synthetic readings), an
  uncorrectable one 10 steps before `--until`, and it dies at `--until`;
- noisy: rank 0's compute takes up to 2x as long, drawn afresh every step; it never fails (must not be drained).

Per run: steps_redone (steps computed twice), wall_s (first to last step), goodput (steps / wall_s), slow_s (time
in steps after the onset until the failing worker left: at reduced speed), drained (a health drain happened) and,
for the failing scenarios, lead_steps (steps between the drain and the death it avoided). The predictor's
precision and recall are over the predictive runs: a drain of a failing node is a true positive, of the noisy node
a false one. Each variant runs --rounds times (3), interleaved, each in a fresh process.

    python bench/health.py [--steps 160] [--onset 40] [--until 130] [--rounds 3] [--only degrade:drain ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rounds import in_own_process, interleaved, publish, summary

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("degrade", "ecc", "noisy")
MODES = ("observe", "drain")
VARIANTS = [f"{s}:{m}" for s in SCENARIOS for m in MODES]


def faults(args, scenario: str) -> str:
    return {
        "degrade": f"[{{kind: degrade, rank: 1, step: {args.onset}, factor: {args.growth}, until: {args.until}}}]",
        "ecc": f"[{{kind: ecc, rank: 1, step: {args.onset}, factor: 2, until: {args.until}, warning: 10}}]",
        "noisy": "[{kind: noisy, rank: 0, step: 1, factor: 2}]",
    }[scenario]


def run(args, variant: str) -> dict:
    """One run in this process: its own three-node Ray, the job, its records."""
    import ray
    from ray.cluster_utils import Cluster

    from etrain.core.config import load_config
    from etrain.core.records import read_jsonl
    from etrain.driver.job import new_run_dir, train

    scenario, mode = variant.split(":")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cfg = load_config(
        "tiny",
        [
            f"train.steps={args.steps}",
            "train.eval_every=0",
            "checkpoint.every=0",
            "cluster.num_workers=2",
            "cluster.warm_pool=1",
            f"health.action={mode}",
            f"faults={faults(args, scenario)}",
            f"data.cache_dir={args.data}",
            f"run.root={tempfile.mkdtemp(prefix='health-')}",
        ],
    )
    run_dir = new_run_dir(cfg)
    ray.init(address=cluster.address, namespace="etrain", logging_level="warning")
    try:
        train(cfg, run_dir, progress=False)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return measure(read_jsonl(run_dir / "metrics.jsonl"), scenario, args)


def measure(records: list[dict], scenario: str, args) -> dict:
    steps = [r for r in records if r["kind"] == "train"]
    changes = [r for r in records if r["kind"] == "membership" and r["reason"] in ("drain", "recover")]
    left = changes[0]["step"] if changes else steps[-1]["step"]  # the failing worker's last committed step
    redone = 0
    for change in (c for c in changes if c["reason"] == "recover"):
        failed = next(r for r in steps if r["step"] == change["step"] + 1)
        redone += int(failed.get("loss") is not None)  # survivors that had finished commit it without redoing it
    wall = steps[-1]["time"] - steps[0]["time"] + steps[0]["step_time_s"]
    drained = [c for c in changes if c["reason"] == "drain"]
    onset = 1 if scenario == "noisy" else args.onset
    return {
        "steps": len(steps),
        "steps_redone": redone,
        "wall_s": wall,
        "goodput": len(steps) / wall,
        "slow_s": sum(r["step_time_s"] for r in steps if onset <= r["step"] <= left and "step_time_s" in r),
        "drained": len(drained),
        "recovered": sum(c["reason"] == "recover" for c in changes),
        "lead_steps": args.until - drained[0]["step"] if drained and scenario != "noisy" else None,
    }


def launch(args, variant: str) -> dict:
    return in_own_process(__file__, ["--variant", variant, *forward(args)], variant)


def forward(args) -> list[str]:
    return [
        *("--steps", str(args.steps), "--onset", str(args.onset), "--until", str(args.until)),
        *("--growth", str(args.growth), "--data", args.data),
    ]


def predictor(runs: dict[str, list[dict]]) -> dict:
    """Over the predictive runs: precision and recall of the drains, and their lead time."""
    tp = sum(r["drained"] > 0 for s in ("degrade", "ecc") for r in runs.get(f"{s}:drain", []))
    positives = sum(len(runs.get(f"{s}:drain", [])) for s in ("degrade", "ecc"))
    fp = sum(r["drained"] > 0 for r in runs.get("noisy:drain", []))
    leads = [r["lead_steps"] for s in ("degrade", "ecc") for r in runs.get(f"{s}:drain", []) if r["lead_steps"]]
    return {
        "precision": tp / (tp + fp) if tp + fp else None,
        "recall": tp / positives if positives else None,
        "false_drains_of_the_noisy_node": fp,
        "lead_steps_min": min(leads, default=None),
        "lead_steps_median": sorted(leads)[len(leads) // 2] if leads else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--onset", type=int, default=40, help="the step the failing scenarios begin at")
    p.add_argument("--until", type=int, default=130, help="the step the failing worker dies at")
    p.add_argument("--growth", type=float, default=1.25, help="degrade: the fault's factor")
    p.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "etrain-bench-data"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", nargs="+", choices=VARIANTS, default=VARIANTS)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "health.json"), help="'' to not save")
    p.add_argument("--variant", choices=VARIANTS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run(args, args.variant)))
        return
    runs = interleaved(
        args.rounds,
        args.only,
        lambda variant: launch(args, variant),
        lambda v, r: (
            f"{v:16s} goodput {r['goodput']:5.2f} steps/s  redone {r['steps_redone']}  drained "
            f"{r['drained']}  wall {r['wall_s']:6.1f} s"
        ),
    )
    rows = {v: summary([{k: x for k, x in r.items() if x is not None} for r in rs]) for v, rs in runs.items()}
    ratios = {
        f"{s}_goodput_drain_vs_observe": rows[f"{s}:drain"]["goodput"]["median"]
        / rows[f"{s}:observe"]["goodput"]["median"]
        - 1
        for s in SCENARIOS
        if f"{s}:drain" in rows and f"{s}:observe" in rows
    }
    report = {
        "machine": "2 cores; 3 raylets of 1 CPU (ray.cluster_utils.Cluster); tiny GPT, 2 workers + 1 warm",
        "args": {k: v for k, v in vars(args).items() if k not in ("variant", "out", "only")},
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
        "runs": runs,
        "ratios": ratios | predictor(runs),
    }
    publish(report, "ratios", args.out)


if __name__ == "__main__":
    main()
