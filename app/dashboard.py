"""The run's live metrics on the Ray dashboard and its Prometheus endpoint (`ray.util.metrics`).

The coordinator publishes every record it writes to `metrics.jsonl` here too, so
the dashboard and the run directory never disagree. Prometheus names carry Ray's
`ray_` prefix (`ray_etrain_loss`); every series has a `run` tag.
`configs/grafana/etrain.json` is a Grafana dashboard of them.
"""

from __future__ import annotations

import time

from ray.util.metrics import Counter, Gauge, Histogram

from app.config import ModelConfig

STEP_PARTS = ("compute", "communication", "data_wait", "other", "checkpoint_stall")


def flops_per_token(model: ModelConfig, params: int) -> float:
    """Training FLOPs per token: 6 per parameter plus attention (PaLM appendix B, as nanoGPT counts)."""
    return 6 * params + 12 * model.n_layer * model.d_model * model.seq_len


def matmul_peak(device, dtype, seconds: float = 0.05) -> float:
    """FLOP/s of a square matmul on this worker's device: the ceiling MFU is measured against.
    Measured rather than looked up, so it is right for CPUs and GPU SKUs alike; a GPU needs a
    large matmul to reach its peak."""
    import torch

    size = 8192 if device.type == "cuda" else 512
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a @ b  # first call: kernel selection, allocation
    sync()
    reps, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds or reps < 3:
        a @ b
        sync()
        reps += 1
    return 2 * size**3 * reps / elapsed


class Dashboard:
    def __init__(self, run: str):
        self.tags = {"run": run}
        keys = ("run",)
        self.gauges = {
            name: Gauge(f"etrain_{name}", text, tag_keys=keys)
            for name, text in {
                "step": "last committed step",
                "loss": "training loss of the last step",
                "eval_loss": "loss on the held-out set at the last evaluation",
                "tokens_per_second": "tokens trained per second, over the last step",
                "mfu": "model FLOPs utilisation: achieved FLOP/s over the members' measured matmul peak",
                "grad_norm": "gradient norm of the last step (before clipping)",
                "world_size": "workers in the process group",
                "warm_pool_size": "warm workers ready to join",
                "cache_hit_rate": "share of the last step's samples served from the node's shard cache",
                "checkpoint_stall_seconds": "how long the last save held up training",
                "checkpoint_step": "step of the last committed checkpoint",
            }.items()
        }
        self.step_seconds = Gauge(
            "etrain_step_seconds", "the last step's time by part: the slowest worker's, and the save that held it up", tag_keys=("run", "part")
        )
        self.scale_latency = Gauge("etrain_scale_latency_seconds", "the last membership change, from detection to first step", tag_keys=("run", "reason"))
        self.scale_events = Counter("etrain_scale_events", "membership changes", tag_keys=("run", "reason"))
        self.fetched = Counter("etrain_fetched_bytes", "shard bytes the node caches fetched from storage", tag_keys=keys)
        self.grad_norms = Histogram(
            "etrain_grad_norm_distribution", "gradient norms", boundaries=[0.01, 0.03, 0.1, 0.3, 0.5, 1, 2, 3, 5, 10, 30, 100], tag_keys=keys
        )

    def _set(self, name: str, value) -> None:
        if value is not None:
            self.gauges[name].set(float(value), tags=self.tags)

    def pool(self, ready: int) -> None:
        self._set("warm_pool_size", ready)

    def publish(self, record: dict) -> None:
        kind = record["kind"]
        if kind == "train":
            self._train(record)
        elif kind == "eval":
            self._set("eval_loss", record["eval_loss"])
        elif kind == "membership":
            tags = {**self.tags, "reason": record["reason"]}
            self.scale_events.inc(1, tags=tags)
            self.scale_latency.set(record["total_s"], tags=tags)
            self._set("world_size", record["world_after"])
        elif kind == "checkpoint":
            self._set("checkpoint_step", record["step"])
            self._set("checkpoint_stall_seconds", record.get("stall_s"))

    def _train(self, r: dict) -> None:
        for gauge, field in (
            ("step", "step"),
            ("loss", "loss"),
            ("tokens_per_second", "tokens_per_s"),
            ("mfu", "mfu"),
            ("grad_norm", "grad_norm"),
            ("world_size", "world_size"),
        ):
            self._set(gauge, r.get(field))
        if r.get("grad_norm") is not None and r["grad_norm"] == r["grad_norm"]:  # NaN has no bucket
            self.grad_norms.observe(r["grad_norm"], tags=self.tags)
        if "compute_s" in r:  # a step with every member's result (not parameter-server mode)
            for part in STEP_PARTS:
                self.step_seconds.set(r[f"{part}_s"], tags={**self.tags, "part": part})
        served = r.get("cache_hits", 0) + r.get("cache_misses", 0)
        if served:
            self._set("cache_hit_rate", r["cache_hits"] / served)
        if r.get("fetched_bytes"):
            self.fetched.inc(r["fetched_bytes"], tags=self.tags)
