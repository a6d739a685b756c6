"""How one step's work and gradients are spread over the workers: the layout of a model replica (parallel),
gradient synchronisation (comm, with DiLoCo's), and the straggler-aware split of the batch (balance)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from etrain.core.config.base import Section


@dataclass(frozen=True)
class Coords:
    """Where a rank sits: its replica (the data-parallel index), its pipeline stage, its parameter shard (of
    parallel.shard) and its tensor slice (of parallel.tp)."""

    replica: int
    stage: int
    shard: int
    tp_rank: int

    @property
    def place(self) -> tuple[int, int, int]:
        """Its place in a replica, which a rank of another replica at the same place (its twin) shares."""
        return self.stage, self.shard, self.tp_rank


class ParallelConfig(Section):
    """How one model replica is laid out (etrain/core/parallel.py): `tp` ranks split each block's tensors, `pp` ranks
    split the blocks into pipeline stages, `shard` ranks split every parameter, its gradient and its optimizer
    state (FSDP2), each computing on its part of the replica's batch. A replica is tp × pp × shard ranks, the unit
    that joins and leaves; the data-parallel degree is the number of replicas, workers / (tp × pp × shard)."""

    tp: int = Field(1, ge=1, description="tensor-parallel ranks per replica (one node): each holds n_head / tp heads")
    pp: int = Field(1, ge=1, description="pipeline stages per replica: each holds about n_layer / pp blocks")
    shard: int = Field(
        1, ge=1, description="ranks per replica sharing its parameters, gradients and optimizer state (FSDP2)"
    )
    microbatches: int = Field(4, ge=1, description="pipeline micro-batches per step (pp > 1); at least pp")
    schedule: Literal["1f1b", "gpipe"] = Field(
        "1f1b", description="1f1b: each micro-batch's activations freed after its backward, soon; gpipe: all at the end"
    )

    @property
    def ranks(self) -> int:
        """Ranks per replica."""
        return self.tp * self.pp * self.shard

    @property
    def per_replica(self) -> int:
        """A replica's share of a batch comes in multiples of this many samples: one per shard rank, each in its
        pipeline micro-batches."""
        return (self.microbatches if self.pp > 1 else 1) * self.shard

    def replicas(self, workers: int) -> int:
        return workers // self.ranks

    def place(self, rank: int) -> Coords:
        """Rank order is TP fastest, then shard, then stage: rank = ((replica · pp + stage) · shard + shard) · tp +
        tp_rank, so a TP group's ranks are consecutive and land on one node when ranks are placed in order."""
        tp, shard = self.tp, self.shard
        return Coords(rank // self.ranks, rank // (tp * shard) % self.pp, rank // tp % shard, rank % tp)

    def misfit(self, workers: int, global_batch: int, what: str) -> str | None:
        """Why `workers` (named `what`) cannot train batches of `global_batch` samples in this layout, or None:
        they must form whole replicas, and the batch split into a whole number of micro-batches for each."""
        if workers % self.ranks:
            return (
                f"{what} is not a whole number of replicas of parallel.tp × parallel.pp × parallel.shard = "
                f"{self.ranks} ranks"
            )
        replicas, per = self.replicas(workers), self.per_replica
        if global_batch % per or global_batch < replicas * per:
            return (
                f"train.global_batch={global_batch} must split into {replicas} replica(s) × whole micro-batches of "
                f"{per} sample(s): a multiple of {per}, at least {replicas * per}"
            )
        return None


class DilocoConfig(Section):
    """comm.mode=diloco (DiLoCo, Douillard et al. 2023): each worker takes `inner_steps` optimizer steps on its share
    of the global batches with no gradient sync at all, then the workers average their pseudo-gradients (the
    parameters of the last outer step minus their own, weighted by the samples each took) and apply outer Nesterov
    SGD to them. One all-reduce of the trained parameters' size every `inner_steps` steps instead of every step."""

    inner_steps: int = Field(
        16, ge=1, description="steps between outer steps (the paper's H, 500 at billions of parameters)"
    )
    outer_lr: float = Field(0.7, gt=0, description="the outer Nesterov step's learning rate (the paper's 0.7)")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="the outer Nesterov momentum (the paper's 0.9)")
    bf16: bool = Field(False, description="all-reduce the pseudo-gradient in bfloat16: half the bytes")


class CommConfig(Section):
    """Gradient synchronisation: all-reduce (bucketed, overlapping the backward pass, optionally
    compressed, optionally with sharded optimizer state), DiLoCo's outer steps, or a bounded-staleness parameter
    server."""

    mode: Literal["allreduce", "diloco", "ps"] = Field(
        "allreduce",
        description="allreduce: DDP ring all-reduce every step; diloco: local steps, an outer step every "
        "comm.diloco.inner_steps (for slow links); ps: parameter-server shards with bounded staleness",
    )
    compression: Literal["none", "fp16", "bf16", "powersgd", "topk"] = Field(
        "none", description="fp16/bf16/powersgd: torch's DDP hooks; topk: ours, with error feedback"
    )
    topk_ratio: float = Field(0.1, gt=0, le=1, description="topk: fraction of gradient entries sent per step")
    powersgd_rank: int = Field(2, ge=1, description="powersgd: rank of the low-rank approximation")
    compress_start: int | None = Field(
        None,
        ge=2,
        description="topk, powersgd: steps of plain all-reduce before compressing (PowerSGD counts them again after "
        "each membership change); None: 20% of train.steps, at least 2 (docs/gradient-sync.md)",
    )
    bucket_mb: float = Field(
        25, gt=0, description="DDP bucket size: gradients are sent bucket by bucket during backward"
    )
    zero: bool = Field(False, description="ZeRO-1: each worker keeps only its shard of the optimizer state")
    ps_shards: int = Field(2, ge=1, description="ps: parameter-server actors, spread over nodes")
    ps_window_s: float = Field(
        0.3, gt=0, description="ps: how long an update waits for a late gradient before going on without it"
    )
    ps_max_staleness: int = Field(
        4, ge=1, description="ps: the most updates a gradient may lag behind; fast workers wait beyond it"
    )
    diloco: DilocoConfig = DilocoConfig()


class BalanceConfig(Section):
    """Straggler-aware split of each step's global batch (the global batch itself never changes)."""

    enabled: bool = Field(True, description="give each worker a share of the batch proportional to its speed")
    slow_below: float = Field(
        0.8, gt=0, lt=1, description="rebalance when a worker is slower than this fraction of the mean speed"
    )
    ema: float = Field(0.3, gt=0, le=1, description="weight of the newest step in each worker's speed average")
    patience: int = Field(
        3, ge=1, description="steps in a row a straggler (or its recovery) must be seen before the split changes"
    )
