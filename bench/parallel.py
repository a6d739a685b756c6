"""Model layouts side by side in one run, on one model and one global batch: data parallel only (2 replicas of the
whole model), tensor parallel (tp=2), pipeline parallel (pp=2, 1F1B and GPipe) and both (tp=2 × pp=2), as gloo
ranks in processes on this machine (app/core/parallel.py).

Per rank: parameter and optimizer bytes, the peak of the activations autograd keeps for backward (CPU has no
allocator statistics: saved tensors are counted as they are packed and freed), and the step time. For the
pipelines, the measured bubble (the share of rank-time a stage is idle: 1 − its compute alone / the step) against
theory, (p − 1) / (m + p − 1). Rounds are interleaved; figures are medians with their spread.

    python bench/parallel.py [--rounds 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from rounds import summary

from app.core.config import ModelConfig, OptimConfig, ParallelConfig
from app.core.local_ranks import SavedBytes, local_group, tensor_bytes
from app.core.model import GPT, next_token_loss
from app.core.optim import make_optimizer
from app.core.parallel import Replica, make_mesh

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = ModelConfig(n_layer=4, n_head=8, d_model=256, seq_len=128, vocab_size=256)
OPTIM = OptimConfig(warmup_steps=0)
BATCH, MICROBATCHES = 32, 8
LAYOUTS = {
    "dp_only": (2, dict()),
    "tp2": (1, dict(tp=2)),
    "pp2_1f1b": (1, dict(pp=2, microbatches=MICROBATCHES)),
    "pp2_gpipe": (1, dict(pp=2, microbatches=MICROBATCHES, schedule="gpipe")),
    "tp2_pp2": (1, dict(tp=2, pp=2, microbatches=MICROBATCHES)),
}


def rank_main(rank: int, world: int, layout: dict, steps: int) -> dict:
    cfg = ParallelConfig(**layout)
    mesh = make_mesh(world, cfg, "cpu")
    torch.manual_seed(0)
    replica = Replica(GPT(MODEL), mesh, cfg, torch.device("cpu"))
    optimizer = make_optimizer(replica.model, OPTIM)
    at, replicas = cfg.place(rank), cfg.replicas(world)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, MODEL.vocab_size, (BATCH, MODEL.seq_len + 1), generator=g).chunk(replicas)[at.replica]
    saved, times, pipe = SavedBytes(), [], []
    for _ in range(steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        with saved:
            replica.forward_backward(rows[:, :-1], rows[:, 1:])
        pipe.append(time.perf_counter() - started)
        replica.sync_and_clip(1.0)
        optimizer.step()
        times.append(time.perf_counter() - started)
    step_s = statistics.median(times[2:])
    out = {
        "param_bytes": tensor_bytes(replica.model.parameters()),
        "optimizer_bytes": tensor_bytes(t for s in optimizer.state.values() for t in s.values() if t.dim()),
        "activation_peak_bytes": saved.peak,
        "step_s": step_s,
    }
    if cfg.pp > 1:
        # the schedule's time against this stage's compute alone; the gradient sync and update are no bubble
        out["bubble"] = 1 - stage_alone_s(replica, rows, cfg.microbatches) / statistics.median(pipe[2:])
        out["bubble_theory"] = (cfg.pp - 1) / (cfg.microbatches + cfg.pp - 1)
    return out


def stage_alone_s(replica: Replica, rows: torch.Tensor, microbatches: int, repeats: int = 3) -> float:
    """This stage's forward and backward of one step's micro-batches with no pipeline to wait on: its busy time
    in a step (the best of `repeats`)."""
    model, first, last = replica.model, replica.at.stage == 0, replica.at.stage == replica.cfg.pp - 1
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for mb in rows.chunk(microbatches):
            x = mb[:, :-1] if first else torch.randn(len(mb), MODEL.seq_len, MODEL.d_model, requires_grad=True)
            out = model.logits(x)
            if last:
                next_token_loss(out, mb[:, 1:]).backward()
            else:
                out.backward(torch.ones_like(out))
        best = min(best, time.perf_counter() - started)
    model.zero_grad(set_to_none=True)
    return best


def measure(name: str, steps: int) -> dict:
    replicas, layout = LAYOUTS[name]
    cfg = ParallelConfig(**layout)
    ranks = local_group(replicas * cfg.ranks, rank_main, layout, steps)
    worst = max(ranks.values(), key=lambda r: r["param_bytes"] + r["optimizer_bytes"])
    figure = {
        "param_optimizer_bytes_per_rank": worst["param_bytes"] + worst["optimizer_bytes"],
        "activation_peak_bytes_per_rank": max(r["activation_peak_bytes"] for r in ranks.values()),
        "step_s": max(r["step_s"] for r in ranks.values()),
    }
    if cfg.pp > 1:
        # the busiest stage's idle share is what theory's equal stages describe; a lighter stage idles more
        figure["bubble"] = min(r["bubble"] for r in ranks.values())
        figure["bubble_mean"] = statistics.mean(r["bubble"] for r in ranks.values())
        figure["bubble_theory"] = worst["bubble_theory"]
    return figure


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every layout; figures are medians")
    p.add_argument("--steps", type=int, default=12, help="steps per layout and round (the first two are left out)")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for round_ in range(args.rounds):
        for name in LAYOUTS:
            runs[name].append(measure(name, args.steps))
            r = runs[name][-1]
            print(
                f"round {round_ + 1}  {name:10s} param+optim {r['param_optimizer_bytes_per_rank'] / 2**20:6.1f} MiB  "
                f"activations {r['activation_peak_bytes_per_rank'] / 2**20:6.1f} MiB  step {r['step_s']:.3f} s"
                + (f"  bubble {r['bubble']:.2f} (theory {r['bubble_theory']:.2f})" if "bubble" in r else ""),
                flush=True,
            )
    rows = {name: summary(r) for name, r in runs.items()}
    med = {name: {k: v["median"] for k, v in row.items()} for name, row in rows.items()}
    ratios = {
        "tp2_vs_dp_only_param_optimizer_memory": med["tp2"]["param_optimizer_bytes_per_rank"]
        / med["dp_only"]["param_optimizer_bytes_per_rank"],
        "pp2_1f1b_vs_gpipe_activation_memory": med["pp2_1f1b"]["activation_peak_bytes_per_rank"]
        / med["pp2_gpipe"]["activation_peak_bytes_per_rank"],
        "pp2_1f1b_bubble_vs_theory": med["pp2_1f1b"]["bubble"] / med["pp2_1f1b"]["bubble_theory"],
        "pp2_gpipe_bubble_vs_theory": med["pp2_gpipe"]["bubble"] / med["pp2_gpipe"]["bubble_theory"],
        **{f"{name}_vs_dp_only_step_time": med[name]["step_s"] / med["dp_only"]["step_s"] for name in LAYOUTS},
    }
    for key, value in ratios.items():
        print(f"{key:45s} {value:.3f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "parallel.json").write_text(
        json.dumps(
            {
                "model": MODEL.model_dump(),
                "global_batch": BATCH,
                "microbatches": MICROBATCHES,
                "rounds": args.rounds,
                "steps": args.steps,
                "machine": f"CPU, {os.cpu_count()} cores, gloo; one torch thread per rank",
                "layouts": rows,
                "ratios": ratios,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
