"""When a communication mode pays: the bytes a ring collective puts on each rank's link, and a step-time model that
tells, from a run's measured step split and bytes, what another mode would save.

The model (docs/gradient-sync.md): a step takes T = C + M, where M (the records' communication_s) is the time
spent on collectives beyond the local backward pass, and M grows with the bytes each rank puts on its link at the
seconds per byte the run measured. Another mode changes only M, by the ratio of its wire bytes to the run's:

    dense all-reduce of D bytes      2(N-1)/N x D           bf16: half that
    top-k at ratio r (all-gather)    (N-1) x r x D          (4 bytes a kept entry, as a dense fp32 entry)
    DiLoCo, H inner steps            2(N-1)/N x D / H       (one all-reduce of the parameters per H steps)

It leaves out what does not scale with bytes (latency, a collective's fixed cost), so it over-promises where M is
mostly fixed cost, and compression's and DiLoCo's own compute; and it says nothing of the loss, which the
benchmarks measure (bench/results/comm.json, lowband.json).
"""

from __future__ import annotations

import math
from statistics import mean

BOUND_AT = 0.25  # communication's share of a step above which the run is called communication-bound


def wire_bytes(nbytes: float, world: int, collective: str = "allreduce") -> float:
    """Bytes a rank puts on its link for a ring collective of `nbytes` per rank among `world` ranks."""
    if world < 2:
        return 0.0
    if collective == "allreduce":
        return 2 * (world - 1) / world * nbytes
    if collective == "allgather":
        return (world - 1) * nbytes
    raise ValueError(f"unknown collective {collective!r}: allreduce or allgather")


def hops(world: int, collective: str = "allreduce") -> int:
    """Steps of a ring collective, each paying the link's latency once."""
    if world < 2:
        return 0
    return 2 * (world - 1) if collective == "allreduce" else world - 1


def seconds(nbytes: float, world: int, gbps: float, latency_ms: float, collective: str = "allreduce") -> float:
    """The modelled time of one ring collective of `nbytes` per rank among `world` ranks on a link of `gbps` Gbit/s
    and `latency_ms` a hop (a `link` fault's: etrain/worker/link.py makes collectives take it)."""
    return hops(world, collective) * latency_ms / 1e3 + wire_bytes(nbytes, world, collective) * 8 / (gbps * 1e9)


def gradient_sync_s(grad_bytes: float, bucket_mb: float, world: int, gbps: float, latency_ms: float) -> float:
    """A dense step's gradient all-reduce on such a link, DDP's way: a first bucket of 1 MB, then buckets of
    `bucket_mb`, each its own collective (each pays the ring's latency), all through the one link."""
    buckets = 1 + math.ceil(max(0.0, grad_bytes - 2**20) / (bucket_mb * 2**20))
    return buckets * hops(world) * latency_ms / 1e3 + seconds(grad_bytes, world, gbps, 0.0)


def advise(train: list[dict], topk_ratio: float = 0.1, inner_steps: int = 16, gathered: bool = False) -> dict | None:
    """From a run's train records: communication's share of the step, whether it bounds the run, and each mode's
    step time by the model above (None before two complete steps at one world size with two or more workers).
    `gathered`: the run's own collectives are all-gathers (top-k's)."""
    done = [r for r in train if r.get("loss") is not None and r.get("step_time_s") and r.get("dense_bytes")]
    world = done[-1]["world_size"] if done else 0
    steady = [r for r in done[1:] if r["world_size"] == world]
    if world < 2 or not steady:
        return None
    step_s, comm_s = mean(r["step_time_s"] for r in steady), mean(r.get("communication_s") or 0 for r in steady)
    sent = mean(r.get("comm_bytes") or 0 for r in steady) / world  # a rank's, each step
    dense = mean(r["dense_bytes"] for r in steady) / world
    dense_wire = wire_bytes(dense, world)
    per_byte = comm_s / wire_bytes(sent, world, "allgather" if gathered else "allreduce") if sent else 0.0
    wires = {
        "allreduce": dense_wire,
        "allreduce bf16": dense_wire / 2,
        f"topk ratio {topk_ratio:g}": wire_bytes(topk_ratio * dense, world, "allgather"),
        f"diloco H={inner_steps}": dense_wire / inner_steps,
        f"diloco H={inner_steps} bf16": dense_wire / inner_steps / 2,
    }
    modes = {name: step_s - comm_s + per_byte * wire for name, wire in wires.items()}
    best = min(modes, key=modes.get)
    share = comm_s / step_s
    return {
        "world_size": world,
        "step_s": step_s,
        "communication_s": comm_s,
        "share": share,
        "bound": share >= BOUND_AT,
        "bytes_per_step": sent,
        "seconds_per_byte": per_byte,
        "modes": modes,
        "best": best,
        "advice": _advice(share, step_s, modes, best),
    }


def _advice(share: float, step_s: float, modes: dict[str, float], best: str) -> str:
    said, faster = f"communication takes {share:.0%} of a step", step_s / modes[best]
    if share < BOUND_AT:
        return f"{said}: it does not bound this run; no mode would save much (best: {best}, {faster:.2f}x)"
    caveat = (
        " at a loss that stays within a few percent of dense at equal samples (bench/results/lowband.json)"
        if best.startswith("diloco")
        else " (top-k ends about 7% above dense in eval loss at equal steps here, warm-up included: bench/README.md)"
        if best.startswith("topk")
        else ""
    )
    return f"{said}: it bounds this run; {best} would make steps {faster:.2f}x faster by the model{caveat}"
