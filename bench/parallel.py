"""Model layouts side by side in one run, on one model and one global batch: data parallel only (2 replicas of the
whole model), tensor parallel (tp=2), pipeline parallel (pp=2, 1F1B and GPipe) and both (tp=2 × pp=2), as gloo
ranks in processes on this machine (etrain/core/parallel.py).

Per rank: parameter and optimizer bytes, the peak of the activations autograd keeps for backward (CPU has no
allocator statistics: saved tensors are counted as they are packed and freed), and the step time. For the
pipelines, the measured bubble (the share of rank-time a stage is idle: 1 − its compute alone / the step) against
theory, (p − 1) / (m + p − 1); and again with stages of fixed, known cost (`_fixed`: blocks that sleep), which
separates the schedule's own overhead from the ranks' competition for the cores, with the hop of a micro-batch's
activations between the stages. Rounds are interleaved; figures are medians with their spread.

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

from etrain.core.config import ModelConfig, OptimConfig, ParallelConfig
from etrain.core.local_ranks import SavedBytes, local_group, tensor_bytes
from etrain.core.models.gpt.model import GPT
from etrain.core.models.shared import next_token_loss
from etrain.core.optim import make_optimizer
from etrain.core.parallel import Replica, make_mesh

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
    "pp2_1f1b_fixed": (1, dict(pp=2, microbatches=MICROBATCHES)),
    "pp2_gpipe_fixed": (1, dict(pp=2, microbatches=MICROBATCHES, schedule="gpipe")),
}
# Stages of fixed, known cost: each block of a tiny model waits FIXED_MS in its forward and twice that in its backward
# (a sleep, which holds no core), so the schedule's own overhead shows apart from the cores its ranks compete for.
FIXED_MS = 4.0
FIXED_MODEL = ModelConfig(n_layer=4, n_head=2, d_model=32, seq_len=16, vocab_size=256)


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(FIXED_MS / 1000)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * FIXED_MS / 1000)
        return grad


class FixedCost(torch.nn.Module):
    """A block, then a wait of known length each way."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, *args, **kwargs):
        return _Wait.apply(self.block(x, *args, **kwargs))


def model_of(name: str) -> tuple[ModelConfig, GPT]:
    """The layout's model: the bench's, or for a `_fixed` layout the tiny one with blocks of fixed cost."""
    if not name.endswith("_fixed"):
        return MODEL, GPT(MODEL)
    model = GPT(FIXED_MODEL)
    for key in list(model.blocks):
        model.blocks[key] = FixedCost(model.blocks[key])
    return FIXED_MODEL, model


def rank_main(rank: int, world: int, name: str, steps: int) -> dict:
    cfg = ParallelConfig(**LAYOUTS[name][1])
    mesh = make_mesh(world, cfg, "cpu")
    torch.manual_seed(0)
    shape, model = model_of(name)
    replica = Replica(model, mesh, cfg, torch.device("cpu"))
    optimizer = make_optimizer(replica.model, OPTIM)
    at, replicas = cfg.place(rank), cfg.replicas(world)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, shape.vocab_size, (BATCH, shape.seq_len + 1), generator=g).chunk(replicas)[at.replica]
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
        out["bubble"] = 1 - stage_alone_s(replica, rows, cfg.microbatches, shape) / statistics.median(pipe[2:])
        out["bubble_theory"] = (cfg.pp - 1) / (cfg.microbatches + cfg.pp - 1)
        if world == cfg.pp == 2:  # what theory leaves out: a hop of a micro-batch's activations between the stages
            out["hop_s"] = hop_s(rank, torch.zeros(len(rows) // cfg.microbatches, shape.seq_len, shape.d_model))
    return out


def hop_s(rank: int, activations: torch.Tensor, trips: int = 30) -> float:
    """One way of a ping-pong of `activations` between ranks 0 and 1 (gloo send and receive), the median trip."""
    import torch.distributed as dist

    times = []
    for _ in range(trips):
        started = time.perf_counter()
        if rank == 0:
            dist.send(activations, 1)
            dist.recv(activations, 1)
        else:
            dist.recv(activations, 0)
            dist.send(activations, 0)
        times.append((time.perf_counter() - started) / 2)
    return statistics.median(times)


def stage_alone_s(
    replica: Replica, rows: torch.Tensor, microbatches: int, shape: ModelConfig, repeats: int = 3
) -> float:
    """This stage's forward and backward of one step's micro-batches with no pipeline to wait on: its busy time
    in a step (the best of `repeats`)."""
    model, first, last = replica.model, replica.at.stage == 0, replica.at.stage == replica.cfg.pp - 1
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for mb in rows.chunk(microbatches):
            x = mb[:, :-1] if first else torch.randn(len(mb), shape.seq_len, shape.d_model, requires_grad=True)
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
    ranks = local_group(replicas * cfg.ranks, rank_main, name, steps)
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
        if "hop_s" in worst:
            figure["hop_s"] = worst["hop_s"]
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
        "pp2_1f1b_fixed_bubble_vs_theory": med["pp2_1f1b_fixed"]["bubble"] / med["pp2_1f1b_fixed"]["bubble_theory"],
        "pp2_gpipe_fixed_bubble_vs_theory": med["pp2_gpipe_fixed"]["bubble"] / med["pp2_gpipe_fixed"]["bubble_theory"],
        **{
            f"{name}_vs_dp_only_step_time": med[name]["step_s"] / med["dp_only"]["step_s"]
            for name in LAYOUTS
            if not name.endswith("_fixed")
        },
    }
    for key, value in ratios.items():
        print(f"{key:45s} {value:.3f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "parallel.json").write_text(
        json.dumps(
            {
                "model": MODEL.model_dump(),
                "fixed_cost": {"model": FIXED_MODEL.model_dump(), "block_forward_ms": FIXED_MS, "backward": "2x"},
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
