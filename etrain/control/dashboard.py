"""The run's live metrics on the Ray dashboard and its Prometheus endpoint (`ray.util.metrics`).

The coordinator publishes every record it writes to `metrics.jsonl` here too, so
the dashboard and the run directory never disagree. Prometheus names carry Ray's
`ray_` prefix (`ray_etrain_loss`); every series has a `run` tag.
`etrain/configs/grafana/etrain.json` is a Grafana dashboard of them.

Every gauge that has a value is set again at each step: a series Ray's exporter has not
seen set for a while drops out of the scrape, and a panel of the last checkpoint or the
last scale event would go blank between events.
"""

from __future__ import annotations

from urllib.parse import quote

from ray.util.metrics import Counter, Gauge, Histogram

from etrain.core.config import ParallelConfig
from etrain.core.records import STEP_PARTS


def run_tag(run: str) -> str:
    """The run's name as the `run` tag: Ray's metrics take ASCII tags only, so a name in another script is
    percent-encoded (模型 → %E6%A8%A1%E5%9E%8B), as in a URL."""
    return run if run.isascii() else quote(run, safe="")


class Dashboard:
    def __init__(self, run: str, parallel: ParallelConfig | None = None):
        self.tags, self.parallel = {"run": run_tag(run)}, parallel or ParallelConfig()  # how a replica is laid out
        keys = ("run",)
        self.gauges = {
            name: Gauge(f"etrain_{name}", text, tag_keys=keys)
            for name, text in {
                "step": "last committed step",
                "loss": "training loss of the last step",
                "eval_loss": "loss on the held-out set at the last evaluation",
                "tokens_per_second": "tokens trained per second, over the last step",
                "mfu": "model FLOPs utilisation: achieved FLOP/s over the members' peak (GPU only; core/flops.py)",
                "grad_norm": "gradient norm of the last step (before clipping)",
                "world_size": "workers in the process group",
                "replicas": "model replicas in the process group: workers / (tp * pp * shard of the layout)",
                "warm_pool_ready": "warm-pool workers ready to join",
                "cache_hit_rate": "share of the shard requests served from the node caches, since the run started",
                "checkpoint_stall_seconds": "how long the last save held up training",
                "checkpoint_step": "step of the last committed checkpoint",
            }.items()
        }
        self.step_seconds = Gauge(
            "etrain_step_seconds",
            "the last step's time by part: the slowest worker's, and the save that held it up",
            tag_keys=("run", "part"),
        )
        self.scale_latency = Gauge(
            "etrain_scale_latency_seconds",
            "the last membership change, from detection to first step",
            tag_keys=("run", "reason"),
        )
        self.scale_events = Counter("etrain_scale_events", "membership changes", tag_keys=("run", "reason"))
        self.fetched = Counter(
            "etrain_fetched_bytes", "shard bytes the node caches fetched from storage", tag_keys=keys
        )
        self.grad_norms = Histogram(
            "etrain_grad_norm_distribution",
            "gradient norms",
            boundaries=[0.01, 0.03, 0.1, 0.3, 0.5, 1, 2, 3, 5, 10, 30, 100],
            tag_keys=keys,
        )
        # Ray 2.60 exports a histogram's _sum from its buckets' midpoints; the exact sum (for the mean) is this.
        self.grad_norm_total = Counter(
            "etrain_grad_norms", "the sum of every gradient norm (the mean: over ..._distribution_count)", tag_keys=keys
        )
        self.risk = Gauge(
            "etrain_node_risk",
            "each node's failure risk, 0 to 1 (etrain/control/health_watch.py); at health.drain_at it is drained",
            tag_keys=("run", "node"),
        )
        self.held: dict = {}  # (gauge name, extra tag) -> (gauge, value, tags): what each step sets again
        self.cache = {"hits": 0, "served": 0}

    def _set(self, name: str, value, gauge=None, **extra) -> None:
        if value is not None:
            gauge, tags = gauge or self.gauges[name], {**self.tags, **extra}
            gauge.set(float(value), tags=tags)
            self.held[_held(name, extra)] = (gauge, float(value), tags)

    def node_risk(self, node: str, score: float) -> None:
        held = self.held.get(_held("risk", {"node": node}))
        if held is None or held[1] != score:  # unchanged, a train record sets it again (every node, every step)
            self._set("risk", score, self.risk, node=node)

    def pool(self, ready: int) -> None:
        self._set("warm_pool_ready", ready)

    def publish(self, record: dict) -> None:
        kind = record["kind"]
        if kind == "train":
            self._train(record)
        elif kind == "eval":
            self._set("eval_loss", record["eval_loss"])
        elif kind == "membership":
            self.scale_events.inc(1, tags={**self.tags, "reason": record["reason"]})
            self._set("scale_latency", record["total_s"], self.scale_latency, reason=record["reason"])
            self._set("world_size", record["world_after"])
            self._set("replicas", self.parallel.replicas(record["world_after"]))
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
        self._set("replicas", self.parallel.replicas(r["world_size"]))
        if r.get("grad_norm") is not None and r["grad_norm"] == r["grad_norm"]:  # NaN has no bucket
            self.grad_norms.observe(r["grad_norm"], tags=self.tags)
            if r["grad_norm"] > 0:  # Ray's counters refuse a zero increment (a PPO step whose scores were all alike)
                self.grad_norm_total.inc(r["grad_norm"], tags=self.tags)
        if "compute_s" in r:  # a step with every member's result (not parameter-server mode)
            for part in STEP_PARTS:
                self._set("step_seconds", r.get(f"{part}_s"), self.step_seconds, part=part)
        self.cache["hits"] += r.get("cache_hits", 0)
        self.cache["served"] += r.get("cache_hits", 0) + r.get("cache_misses", 0)
        if self.cache["served"]:
            self._set("cache_hit_rate", self.cache["hits"] / self.cache["served"])
        if r.get("fetched_bytes"):
            self.fetched.inc(r["fetched_bytes"], tags=self.tags)
        for gauge, value, tags in self.held.values():  # the values of earlier events, so their series stay
            gauge.set(value, tags=tags)


def _held(name: str, extra: dict) -> tuple:
    """A gauge's key in Dashboard.held: its name and its tags beyond the run's."""
    return name, tuple(extra.items())
