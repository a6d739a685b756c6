"""GRPO against PPO on a verifiable reward, the same samples, side by side in one run: the tiny GPT, 2 workers, one
local Ray instance, LoRA from the same base.

The task: after a code prompt ("x = ", "return "...), answer with a number. The checker is exact: 1 when the
response starts with a whole number (digits, then neither a letter, a digit nor a point), else 0 (no partial
credit). Each run trains on the same number
of responses a step (ppo.rollouts) for the same steps:

- ppo: PPO as `etrain ppo` runs it, one response a prompt, value head and GAE, 2 epochs × 2 minibatches a step;
- grpo: `etrain grpo`'s method, 4 responses a prompt (a quarter of the prompts), the same 2 × 2 updates;
- grpo_1: GRPO as DeepSeekMath ran it, one update a step (ppo.epochs = ppo.minibatches = 1).

Per run: the held-out reward (ppo.eval_prompts prompts) before and after, the training time (the sum of the steps'
times), the peak resident memory of the workers, and the trained state's bytes (parameters and optimizer: where a
value head, or a separate critic, would show). Variants run in interleaved rounds, each round at its own seed (one
trajectory is one draw of the prompts and samples: the rounds are the spread); the results file holds each
figure's median over them and its spread, and the training time GRPO took to reach PPO's final reward (the mean of
its last 5 steps' rollouts) against PPO's whole time.

    python bench/grpo.py [--rounds 5] [--base-steps 200] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ray
from rounds import interleaved, publish, summary

from etrain.core.config import load_config, override
from etrain.core.finetune import finetune_config
from etrain.core.records import read_jsonl
from etrain.driver.job import new_run_dir, train

RESULTS = Path(__file__).resolve().parent / "results"
CHECKER = '''
import re


def check(prompt, response):
    """1 when the response starts with a whole number (digits not followed by a letter, digit or point), else 0."""
    return float(re.match(r"\\d+(?![\\w.])", response) is not None)
'''
COMMON = ["ppo.rollouts=32", "ppo.response_len=8", "ppo.eval_prompts=128", "optim.lr=1e-2", "optim.warmup_steps=0"]
VARIANTS = {
    "ppo": [],
    "grpo": ["ppo.algorithm=grpo", "ppo.group=4"],
    "grpo_1": ["ppo.algorithm=grpo", "ppo.group=4", "ppo.epochs=1", "ppo.minibatches=1"],
}


def run(name: str, base: Path, reward: str, steps: int, root: str, rnd: int) -> dict:
    sets = [*COMMON, *VARIANTS[name], f"train.steps={steps}", f"train.eval_every={steps}", f"run.root={root}"]
    sets += [f"run.name={name}-{rnd}", f"train.seed={rnd}", f"checkpoint.every={steps}", "cluster.warm_pool=0"]
    cfg = override(finetune_config(str(base), None, sets), {"ppo.reward": reward})
    started = time.perf_counter()
    train(cfg, run_dir := new_run_dir(cfg), progress=False)
    wall = time.perf_counter() - started
    records = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r["eval_reward"] for r in records if r["kind"] == "eval"]
    steps_ = [r for r in records if r["kind"] == "train"]
    elapsed = np.cumsum([r["step_time_s"] for r in steps_])
    rolling = np.convolve([r["reward"] for r in steps_], np.ones(5) / 5, mode="valid")  # the mean of 5 steps
    return {
        "curve": list(zip(elapsed[4:].tolist(), rolling.tolist())),
        "reward_before": evals[0],
        "reward_after": evals[-1],
        "rollout_reward_last5": sum(r["reward"] for r in steps_[-5:]) / 5,
        "kl_last": steps_[-1]["kl"],
        "train_s": sum(r["step_time_s"] for r in steps_),
        "wall_s": wall,
        "peak_rss_bytes": max(max(r["peak_rss"]) for r in steps_),
        "state_bytes": max(steps_[-1]["param_bytes"]) + max(steps_[-1]["optimizer_bytes"]),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--base-steps", type=int, default=200, help="pre-training steps of the base")
    parser.add_argument("--steps", type=int, default=40, help="steps of each RL run")
    parser.add_argument(
        "--data", default=str(Path.home() / ".cache/etrain/data"), help="where the embedded corpus is built"
    )
    parser.add_argument("--out", default=str(RESULTS / "grpo.json"), help="results file ('' to skip)")
    args = parser.parse_args(argv)
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    with tempfile.TemporaryDirectory(prefix="etrain-bench-grpo-") as root:
        (checker := Path(root) / "number.py").write_text(CHECKER)
        sets = [f"run.root={root}", f"data.cache_dir={args.data}", "cluster.warm_pool=0", "train.eval_every=0"]
        cfg = load_config("tiny", [*sets, "run.name=base", f"train.steps={args.base_steps}"])
        train(cfg, base := new_run_dir(cfg), progress=False)
        rounds = dict.fromkeys(VARIANTS, 0)

        def measure(name: str) -> dict:
            rounds[name] += 1  # each round its own seed (prompts, samples, adapters' init), the variants alike
            return run(name, base, f"{checker}:check", args.steps, root, rounds[name])

        def line(name: str, result: dict) -> str:
            return f"{name:>7}: " + json.dumps({k: round(v, 4) for k, v in result.items() if k != "curve"})

        runs = interleaved(args.rounds, list(VARIANTS), measure, line)
    results = {k: summary(v) for k, v in runs.items()}
    med = {k: {f: v["median"] for f, v in r.items()} for k, r in results.items()}
    ratios = {}
    target = med["ppo"]["rollout_reward_last5"]
    ratios["ppo_final_rollout_reward"] = target
    for name in ("grpo", "grpo_1"):
        reached = [next((t for t, r in run["curve"] if r >= target), None) for run in runs[name]]
        ratios |= {
            f"{name}_rounds_reaching_ppo_reward": sum(t is not None for t in reached),
            f"{name}_time_to_ppo_reward_vs_ppo": statistics.median(
                t / med["ppo"]["train_s"] if t is not None else float("inf") for t in reached
            )
            if any(t is not None for t in reached)
            else None,  # none reached it
            f"{name}_reward_after_minus_ppo": med[name]["reward_after"] - med["ppo"]["reward_after"],
            f"{name}_train_time_vs_ppo": med[name]["train_s"] / med["ppo"]["train_s"],
            f"{name}_peak_rss_vs_ppo": med[name]["peak_rss_bytes"] / med["ppo"]["peak_rss_bytes"],
            f"{name}_state_bytes_vs_ppo": med[name]["state_bytes"] / med["ppo"]["state_bytes"],
        }
    report = {
        "machine": "2 cores, tiny GPT (2 layers, 128 wide), LoRA, 2 workers, gloo",
        "task": "a number after a code prompt, checked exactly (bench/grpo.py CHECKER)",
        "rounds": args.rounds,
        "steps": {"base": args.base_steps, "rl": args.steps},
        "responses_per_step": 32,
        "variants": results,
        "ratios": ratios,
    }
    return publish(report, "ratios", args.out)


if __name__ == "__main__":
    main()
