"""Fine-tuning and a large-batch optimizer, side by side in one run: the tiny GPT, 2 workers, one local Ray instance.

1. LoRA vs full fine-tuning from the same base: the tiny GPT pre-trained on the embedded corpus (Python's standard
   library), fine-tuned on a corpus of another kind (the installed Python packages' descriptions, prose and markdown,
   made with `etrain prepare`). Trainable parameters, optimizer state per worker, checkpoint bytes, median step time,
   and the eval loss on the fine-tuning corpus after the same steps, beside the base's own eval loss there.
2. LAMB vs AdamW at 8x the default global batch (128 instead of 16), from scratch, after the same samples: eval loss.
   Each at its own lr (LAMB's trust ratio makes its steps relative to each tensor's norm: it wants a larger one).
3. PPO (LoRA) from the same base on the `digits` reward: the held-out mean reward before and after, and the KL to
   the base at the end.

Variants run in interleaved rounds; the results file holds each figure's median over them and its spread.

    python bench/finetune.py [--rounds 3] [--base-steps 300] [--steps 150] [--large-steps 40] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ray
import torch
from rounds import publish, summary

from etrain.core.config import load_config, override
from etrain.core.finetune import build_model, finetune_config
from etrain.core.records import read_jsonl
from etrain.data import order
from etrain.data.prepare import prepare
from etrain.data.shards import ShardReader, read_manifest
from etrain.driver.job import new_run_dir, train

RESULTS = Path(__file__).resolve().parent / "results"
# Each at the best lr of a one-round sweep on this bench (full: 1e-3, 2e-3; LoRA: 1e-2, 2e-2, 4e-2; all-linear LoRA:
# 1e-2, 2e-2; AdamW at the large batch: 3e-3, 6e-3; LAMB: 3e-3, 9e-3, 2e-2, 4e-2, 8e-2): results/finetune.json's
# "sweep". LoRA as the product's default (rank 8 on attn.q, k, v, proj), and rank 4 on every linear layer.
ALL_LINEAR = "finetune.lora.targets=[attn.q,attn.k,attn.v,attn.proj,mlp.0,mlp.2]"
FINETUNE = {
    "full": ["finetune.method=full", "optim.lr=2e-3"],
    "lora": ["finetune.method=lora", "optim.lr=2e-2"],
    "lora_all_r4": ["finetune.method=lora", ALL_LINEAR, "finetune.lora.rank=4", "optim.lr=1e-2"],
}
LARGE = {"adamw": ["optim.name=adamw", "optim.lr=3e-3"], "lamb": ["optim.name=lamb", "optim.lr=2e-2"]}
SWEEP = {  # eval loss, one round (training here is deterministic: rounds agree exactly)
    "full": {"1e-3": 2.4517, "2e-3": 2.3836},
    "lora": {"1e-2": 2.6799, "2e-2": 2.6668, "4e-2": 2.9229},
    "lora_all_r4": {"1e-2": 2.6212, "2e-2": 2.6285},
    "adamw": {"3e-3": 2.7415, "6e-3": 2.8251},
    "lamb": {"3e-3": 4.2483, "9e-3": 3.3505, "2e-2": 2.6313, "4e-2": 2.6710, "8e-2": 2.8597},
}
LARGE_BATCH = 128  # 8x the tiny preset's 16
PPO = ["ppo.rollouts=32", "ppo.response_len=8", "ppo.eval_prompts=128", "optim.lr=1e-2", "optim.warmup_steps=0"]


def common(root: str, data_dir: str) -> list[str]:
    """Every run: the tiny preset on 2 workers, no warm pool, evaluated at its end only."""
    return [f"run.root={root}", f"data.cache_dir={data_dir}", "cluster.warm_pool=0", "train.eval_every=0"]


def package_descriptions(out: Path) -> Path:
    """A JSONL of the installed distributions' long descriptions: English prose and markdown, unlike the base's code."""
    with open(out, "w") as f:
        for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
            text = dist.metadata.get_payload() or ""
            if len(text) > 500:
                f.write(json.dumps({"text": text}) + "\n")
    return out


def base_eval_loss(cfg, manifest: str) -> float:
    """The base model's loss on the fine-tuning corpus' held-out samples, as the runs evaluate theirs."""
    model = build_model(cfg).eval()
    num_eval = read_manifest(manifest)["splits"]["eval"]["samples"]
    ids = order.take(order.Layout(0, (num_eval,), 1), 0, min(cfg.train.eval_samples, num_eval))
    rows = torch.from_numpy(ShardReader(manifest, "eval").get(ids).astype(np.int64))
    with torch.no_grad():
        losses = [model(chunk[:, :-1], chunk[:, 1:])[1].item() * len(chunk) for chunk in rows.split(16)]
    return sum(losses) / len(rows)


def measured(run_dir: Path) -> dict:
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if r["kind"] == "train"]
    saves = [r for r in records if r["kind"] == "checkpoint"]
    return {
        "eval_loss": [r for r in records if r["kind"] == "eval"][-1]["eval_loss"],
        "step_s": statistics.median(r["step_time_s"] for r in steps[len(steps) // 4 :]),  # past the start-up
        "optimizer_bytes_per_worker": max(steps[-1]["optimizer_bytes"]),
        "checkpoint_bytes": saves[-1]["bytes"],
    }


def run_finetune(name: str, base_run: Path, steps: int, root: str, rnd: int, manifest: str) -> dict:
    cfg = finetune_config(
        str(base_run), None, [*FINETUNE[name], f"data.source={manifest}", f"train.steps={steps}",
                              f"run.root={root}", f"run.name={name}-{rnd}", "checkpoint.every=0"],
    )  # fmt: skip
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    model = build_model(cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trainable_params": trainable, **measured(run_dir)}


def run_ppo(base_run: Path, steps: int, root: str, rnd: int) -> dict:
    overrides = [*PPO, f"train.steps={steps}", f"train.eval_every={steps}", f"run.root={root}", f"run.name=ppo-{rnd}"]
    cfg = override(finetune_config(str(base_run), None, [*overrides, "checkpoint.every=0"]), {"ppo.reward": "digits"})
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    records = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r["eval_reward"] for r in records if r["kind"] == "eval"]
    steps_ = [r for r in records if r["kind"] == "train"]
    return {
        "reward_before": evals[0],
        "reward_after": evals[-1],
        "kl_last": steps_[-1]["kl"],
        "step_s": statistics.median(r["step_time_s"] for r in steps_[len(steps_) // 4 :]),
    }


def run_large(name: str, steps: int, root: str, data_dir: str, rnd: int, extra: tuple[str, ...] = ()) -> dict:
    cfg = load_config(
        "tiny",
        [*common(root, data_dir), *LARGE[name], f"run.name={name}-{rnd}", f"train.steps={steps}",
         f"train.global_batch={LARGE_BATCH}", "train.micro_batch=16", "optim.warmup_steps=5", "checkpoint.every=0",
         *extra],
    )  # fmt: skip
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    return {"samples": steps * LARGE_BATCH, **measured(run_dir)}


def compare(results: dict) -> dict:
    out = {}
    med = {k: {f: v["median"] for f, v in r.items()} for k, r in results.items() if k != "base"}
    for k in ("lora", "lora_all_r4"):
        if k in med and "full" in med:
            full, lora = med["full"], med[k]
            out |= {
                f"{k}_eval_loss_vs_full": lora["eval_loss"] / full["eval_loss"] - 1,
                f"{k}_trainable_params_share": lora["trainable_params"] / full["trainable_params"],
                f"{k}_optimizer_bytes_vs_full": lora["optimizer_bytes_per_worker"] / full["optimizer_bytes_per_worker"],
                f"{k}_checkpoint_bytes_vs_full": lora["checkpoint_bytes"] / full["checkpoint_bytes"],
                f"{k}_step_time_vs_full": lora["step_s"] / full["step_s"],
            }
    if "ppo" in med:
        out["ppo_reward_gain"] = med["ppo"]["reward_after"] - med["ppo"]["reward_before"]
    if "lamb" in med and "adamw" in med:
        out["lamb_eval_loss_vs_adamw"] = med["lamb"]["eval_loss"] / med["adamw"]["eval_loss"] - 1
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base-steps", type=int, default=300, help="pre-training steps of the base")
    parser.add_argument("--steps", type=int, default=150, help="fine-tuning steps of each LoRA / full run")
    parser.add_argument("--large-steps", type=int, default=40, help="steps of each large-batch run")
    parser.add_argument("--ppo-steps", type=int, default=30, help="steps of the PPO run")
    parser.add_argument("--only", nargs="*", choices=[*FINETUNE, *LARGE, "ppo"], help="run only these variants")
    parser.add_argument(
        "--data", default=str(Path.home() / ".cache/etrain/data"), help="where the embedded corpus is built"
    )
    parser.add_argument("--out", default=str(RESULTS / "finetune.json"), help="results file ('' to skip)")
    args = parser.parse_args(argv)
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    wanted = [k for k in [*FINETUNE, "ppo", *LARGE] if not args.only or k in args.only]
    runs: dict[str, list[dict]] = {k: [] for k in wanted}
    with tempfile.TemporaryDirectory(prefix="etrain-bench-finetune-") as root:
        base, manifest, base_loss = None, None, None
        if set(wanted) & {*FINETUNE, "ppo"}:
            started = time.perf_counter()
            cfg = load_config("tiny", [*common(root, args.data), "run.name=base", f"train.steps={args.base_steps}"])
            base = new_run_dir(cfg)
            train(cfg, base, progress=False)
            corpus = f"{root}/packages"
            prepare([str(package_descriptions(Path(root) / "packages.jsonl"))], corpus, cfg, progress=False)
            manifest = f"{corpus}/manifest.json"
            ft = finetune_config(str(base), None, [f"data.source={manifest}", "finetune.method=full"])
            base_loss = base_eval_loss(ft, manifest)
            print(f"base: {args.base_steps} steps, eval loss on the fine-tuning corpus {base_loss:.4f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
        for rnd in range(args.rounds):
            for name in wanted:
                started = time.perf_counter()
                if name in FINETUNE:
                    result = run_finetune(name, base, args.steps, root, rnd, manifest)
                elif name == "ppo":
                    result = run_ppo(base, args.ppo_steps, root, rnd)
                else:
                    result = run_large(name, args.large_steps, root, args.data, rnd)
                runs[name].append(result)
                shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
                took = time.perf_counter() - started
                print(f"round {rnd} {name:>10}: {json.dumps(shown)} ({took:.0f} s)", flush=True)
    results = {k: summary(v) for k, v in runs.items() if v}
    report = {
        "machine": "2 cores, tiny GPT (2 layers, 128 wide), 2 workers, gloo",
        "rounds": args.rounds,
        "steps": {
            "base": args.base_steps,
            "finetune": args.steps,
            "large_batch": args.large_steps,
            "ppo": args.ppo_steps,
        },  # fmt: skip
        "base_eval_loss_on_finetune_corpus": base_loss,
        "sweep": SWEEP,
        "variants": results,
        "ratios": compare(results),
    }
    return publish(report, "ratios", args.out)


if __name__ == "__main__":
    main()
