"""Sharded state side by side in one run, on one model and one global batch: data parallel (2 ranks, each the
whole model), ZeRO-1 (2 ranks, the optimizer state sharded), FSDP2 over 2 and 4 ranks (parallel.shard) and
tp=2 × shard=2, as gloo ranks in processes on this machine (etrain/core/parallel.py).

Per rank: parameter, gradient and optimizer bytes at rest (after an update), the process's peak resident memory
when its part of the model is made and given its values (a rank that joins: the structure on the meta device, its
part's values made tensor by tensor) and after the steps (FSDP gathers a block's parameters for its forward and
backward), each above the process's memory before the model (torch imported); and the step time. CPU figures say
little about GPUs, where FSDP's gathers overlap the compute: the step time is reported, not a target. For the
sharded layouts, a checkpoint both ways on rank 0: the whole state gathered there and written with torch.save (how
layouts saved before torch DCP; training waits throughout) against DCP's asynchronous save (training waits while
each rank copies its shards into its staging buffers, allocated by a run's first save and reused by the later
ones): the time training is blocked by the first save and by a later one, and the memory the first save takes
(rank 0's resident memory sampled every millisecond, above its level before the save).

Every rank runs with MALLOC_MMAP_THRESHOLD_=65536, so that resident memory shows what a rank holds: glibc's
threshold otherwise rises to the size of each block freed (up to 32 MiB), and the buffers FSDP gathers and frees
block by block, all below 32 MiB in this model, stayed in the heap (measured: +700 MiB after one step at shard=4,
+170 MiB with the fixed threshold). Larger tensors are mmapped and returned anyway, and on a GPU the gathered
blocks are device memory, so the product leaves the threshold alone. Its page faults slow every variant's step here.

    python bench/sharded.py [--rounds 3] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rounds import interleaved, publish, summary

from etrain.core import sharded_checkpoint
from etrain.core.config import ModelConfig, OptimConfig, ParallelConfig
from etrain.core.layout_state import full_state, load_full
from etrain.core.local_ranks import local_group, tensor_bytes
from etrain.core.models.gpt.model import GPT
from etrain.core.models.shared import InitialWeights
from etrain.core.optim import make_optimizer, make_param_groups, optimizer_class, optimizer_defaults
from etrain.core.parallel import Replica, make_mesh

RESULTS = Path(__file__).resolve().parent / "results"
SAVE_FIGURES = (
    "gathered_save_s",
    "gathered_save_rss_bytes",
    "dcp_first_blocked_s",
    "dcp_blocked_s",
    "dcp_written_s",
    "dcp_save_rss_bytes",
)
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by each rank's process as it starts
MODEL = ModelConfig(n_layer=8, n_head=8, d_model=768, seq_len=64, vocab_size=256)
OPTIM = OptimConfig(warmup_steps=0)
BATCH = 8
VARIANTS = {  # name -> (ranks, layout; None: the whole model per rank, "zero1": with ZeRO-1's optimizer)
    "data_parallel": (2, None),
    "zero1": (2, "zero1"),
    "shard2": (2, dict(shard=2)),
    "shard4": (4, dict(shard=4)),
    "tp2_shard2": (4, dict(tp=2, shard=2)),
}


def resident() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> int:
    """This process's peak resident memory so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Sampled:
    """The peak of this process's resident memory while the context is open, above its level at the start, sampled
    every millisecond: what one save takes (ru_maxrss keeps the training's peak)."""

    def __enter__(self):
        self.start, self.top, self._done = resident(), resident(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.top = max(self.top, resident())

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.top = max(self.top, resident())
        self.peak = self.top - self.start


def save_costs(rank: int, replica: Replica, optimizer, out: str) -> dict:
    """A checkpoint of a sharded layout both ways, on rank 0: the whole state gathered on rank 0 and written there
    with torch.save (how layouts saved before DCP; training blocked throughout), and DCP's asynchronous save as the
    trainer makes it (training blocked while each rank copies its shards into its staging buffers; written in the
    background). The trainer's first save (at step 0) allocates those buffers, its later saves reuse them: both
    are timed, the memory of the first (the buffers stay)."""
    dist.barrier()
    with Sampled() as gathered:
        started = time.perf_counter()
        full = full_state(replica, optimizer)
        if full is not None:
            torch.save(full, os.path.join(out, "whole.pt"))
        del full
        dist.barrier()
        gathered_s = time.perf_counter() - started
    staging = sharded_checkpoint.stager()
    blocked, written, memory = [], [], []
    for i in range(2):
        with Sampled() as sharded:
            started = time.perf_counter()
            state = sharded_checkpoint.state_dict(replica.model, optimizer)
            saving = sharded_checkpoint.save(state, f"{out}/dcp{i}", dist.group.WORLD, staging)
            blocked.append(time.perf_counter() - started)
            saving.result()
            written.append(time.perf_counter() - started)
        memory.append(sharded.peak)
    staging.close()
    return {
        "gathered_save_s": gathered_s,
        "gathered_save_rss_bytes": gathered.peak,
        "dcp_first_blocked_s": blocked[0],
        "dcp_blocked_s": blocked[1],
        "dcp_written_s": written[1],
        "dcp_save_rss_bytes": memory[0],
    }


def rank_main(rank: int, world: int, layout, steps: int, out: str) -> dict:
    torch.set_num_threads(1)
    before = resident()
    model, optimizer, step, replica = build(rank, world, layout)
    made = peak() - before
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, MODEL.vocab_size, (BATCH, MODEL.seq_len + 1), generator=g)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        step(rows)
        optimizer.step()
        times.append(time.perf_counter() - started)
    held = optimizer.optim if hasattr(optimizer, "optim") else optimizer  # ZeRO-1 wraps its shard's optimizer
    return {
        "param_bytes": tensor_bytes(model.parameters()),
        "grad_bytes": tensor_bytes(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer_bytes": tensor_bytes(t for s in held.state.values() for t in s.values() if t.dim()),
        "made_peak_rss_bytes": made,
        "peak_rss_bytes": peak() - before,
        "step_s": statistics.median(times[1:]),
    } | (save_costs(rank, replica, optimizer, out) if replica is not None else {})


def build(rank: int, world: int, layout):
    """The rank's model, optimizer and step: a whole model (DDP's gradient all-reduce), or its part of a replica
    made as a worker makes it (etrain/worker/laid_out.py)."""
    if layout is None or layout == "zero1":
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        model = GPT(MODEL)
        ddp = DDP(model)
        if layout == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(
                make_param_groups(model, OPTIM), optimizer_class=optimizer_class(OPTIM), **optimizer_defaults(OPTIM)
            )
        else:
            optimizer = make_optimizer(model, OPTIM)

        def step(rows):
            mine = rows.chunk(world)[rank]
            _, loss = ddp(mine[:, :-1], mine[:, 1:])
            loss.backward()

        return model, optimizer, step, None
    cfg = ParallelConfig(**layout)
    with torch.device("meta"):
        model = GPT(MODEL)
    replica = Replica(model, make_mesh(world, cfg, "cpu"), cfg, torch.device("cpu"))
    replica.model.materialize(torch.device("cpu"))
    optimizer = make_optimizer(replica.model, OPTIM)
    load_full(replica, optimizer, {"model": InitialWeights(MODEL, 0), "optim": {}})

    def step(rows):
        replica.forward_backward(rows[:, :-1], rows[:, 1:])
        replica.sync_and_clip(1.0)

    return replica.model, optimizer, step, replica


def measure(name: str, steps: int) -> dict:
    world, layout = VARIANTS[name]
    with tempfile.TemporaryDirectory(prefix="sharded-bench-") as out:
        ranks = local_group(world, rank_main, layout, steps, out)
    first = ranks[0]  # rank 0: the one a gathered save lands on
    ranks = ranks.values()
    saves = {k: first[k] for k in SAVE_FIGURES if k in first}
    return saves | {
        "state_bytes_per_rank": max(r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in ranks),
        "param_bytes_per_rank": max(r["param_bytes"] for r in ranks),
        "grad_bytes_per_rank": max(r["grad_bytes"] for r in ranks),
        "optimizer_bytes_per_rank": max(r["optimizer_bytes"] for r in ranks),
        "made_peak_rss_bytes": max(r["made_peak_rss_bytes"] for r in ranks),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "step_s": max(r["step_s"] for r in ranks),
    }


def line(name: str, r: dict) -> str:
    mib = 2**20
    saves = (
        f"  save: gathered {r['gathered_save_s']:.2f} s {r['gathered_save_rss_bytes'] / mib:.0f} MiB, DCP blocked "
        f"{r['dcp_blocked_s']:.3f} s (first {r['dcp_first_blocked_s']:.3f} s; written {r['dcp_written_s']:.2f} s) "
        f"{r['dcp_save_rss_bytes'] / mib:.0f} MiB"
        if "dcp_blocked_s" in r
        else ""
    )
    return (
        f"{name:14s} param+grad+optim {r['state_bytes_per_rank'] / mib:7.1f} MiB  "
        f"peak RSS when made {r['made_peak_rss_bytes'] / mib:7.1f} MiB, after steps {r['peak_rss_bytes'] / mib:7.1f} "
        f"MiB  step {r['step_s']:.2f} s{saves}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every variant; figures are medians")
    p.add_argument("--steps", type=int, default=6, help="steps per variant and round (the first is left out)")
    p.add_argument("--out", default=str(RESULTS / "sharded.json"), help="where the report goes ('' for nowhere)")
    args = p.parse_args()
    runs = interleaved(args.rounds, list(VARIANTS), lambda name: measure(name, args.steps), line)
    rows = {name: summary(r) for name, r in runs.items()}
    med = {name: {k: v["median"] for k, v in row.items()} for name, row in rows.items()}
    dp = med["data_parallel"]
    ratios = {}
    for name, n in (("shard2", 2), ("shard4", 4), ("tp2_shard2", 4)):
        # the targets: state ≤ 1.1/N of data parallel's, a joining rank's peak RSS ≤ 1.3/N of a whole model's
        ratios[f"{name}_state_bytes_x_N_vs_data_parallel"] = (
            med[name]["state_bytes_per_rank"] * n / dp["state_bytes_per_rank"]
        )
        ratios[f"{name}_made_peak_rss_x_N_vs_data_parallel"] = (
            med[name]["made_peak_rss_bytes"] * n / dp["made_peak_rss_bytes"]
        )
    ratios |= {f"{name}_vs_data_parallel_step_time": med[name]["step_s"] / dp["step_s"] for name in VARIANTS}
    for name, n in (("shard2", 2), ("shard4", 4), ("tp2_shard2", 4)):
        # the issue's targets: DCP's blocked time ≤ 0.1× the gathered save's, rank 0's memory in a save ≤ 1.3/N of it
        ratios[f"{name}_dcp_blocked_vs_gathered_save"] = med[name]["dcp_blocked_s"] / med[name]["gathered_save_s"]
        ratios[f"{name}_dcp_first_blocked_vs_gathered_save"] = (
            med[name]["dcp_first_blocked_s"] / med[name]["gathered_save_s"]
        )
        ratios[f"{name}_dcp_save_rss_x_N_vs_gathered"] = (
            med[name]["dcp_save_rss_bytes"] * n / med[name]["gathered_save_rss_bytes"]
        )
    ratios["zero1_state_bytes_vs_data_parallel"] = med["zero1"]["state_bytes_per_rank"] / dp["state_bytes_per_rank"]
    report = {
        "model": MODEL.model_dump(),
        "params": GPT(MODEL).num_params(),
        "global_batch": BATCH,
        "rounds": args.rounds,
        "steps": args.steps,
        "machine": f"CPU, {os.cpu_count()} cores, gloo; one torch thread per rank; step times say little of a GPU",
        "variants": rows,
        "ratios": ratios,
    }
    publish(report, "ratios", args.out)


if __name__ == "__main__":
    main()
