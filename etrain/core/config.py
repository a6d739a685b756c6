"""One typed config tree, from YAML preset + `--set` overrides to every worker.

Each component owns its section; `Config` composes them. The resolved tree is
saved as `config.yaml` in the run directory and travels inside checkpoints, so a
run can always be reproduced or resumed from what it wrote.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from etrain.core.comm_model import gradient_sync_s
from etrain.core.errors import UsageError

PRESET_DIR = Path(__file__).resolve().parents[1] / "configs"  # package data: a wheel ships them

# What a resume may change: how, where and how long a run goes on (and how gradients travel); never the
# model, data or optimizer.
RESUMABLE = (
    "train.deterministic",
    "train.steps",
    "train.eval_every",
    "train.eval_samples",
    "checkpoint",
    "cluster",
    "timeouts",
    "run",
    "prepare",
    "faults",
    "health",
    "balance",
    "comm",
    "parallel",  # a layout changes where the model's parts live, not what is trained: resumable in any other
)


class ConfigError(UsageError):
    """A config the user gave is wrong; the message says what and how to fix it."""


class Section(BaseModel):
    # No inf or NaN anywhere (optim.lr=.inf would fail only at step 2).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's `true` would pass as 1 (train.steps=true trains one step); a number key takes a number."""
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and annotation in (int, float, int | None, float | None):
            raise ValueError(f"must be a number, not {str(value).lower()}")
        return value


class RopeScaling(Section):
    """Llama 3.1's rotary frequency scaling (Hugging Face's rope_type llama3)."""

    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: int = Field(8192, ge=1)


LLAMA_ONLY = (
    "n_kv_head", "ffn_dim", "head_dim", "rope_theta", "rope_scaling", "norm_eps", "qkv_bias", "o_bias", "mlp_bias"
)  # fmt: skip


class ModelConfig(Section):
    family: Literal["gpt", "llama"] = Field(
        "gpt", description="gpt: etrain/core/model.py; llama: the Llama family (etrain/core/models/llama.py)"
    )
    n_layer: int = Field(2, ge=1, description="transformer blocks")
    n_head: int = Field(4, ge=1, description="attention heads per block")
    d_model: int = Field(128, ge=8, description="residual width; must divide by n_head")
    seq_len: int = Field(128, ge=8, description="tokens per training sequence")
    vocab_size: int = Field(256, ge=2, description="256 for the byte-level tokenizer")
    positions: Literal["rotary", "learned"] = "rotary"
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    tie_weights: bool = Field(True, description="share input embedding and output head")
    n_kv_head: int | None = Field(None, ge=1, description="llama: key/value heads (grouped-query); n_head if unset")
    ffn_dim: int | None = Field(None, ge=1, description="llama: the SwiGLU MLP's width; 8/3 d_model (to 64) if unset")
    head_dim: int | None = Field(None, ge=2, description="llama: width of a head; d_model / n_head if unset")
    rope_theta: float | None = Field(None, gt=0, description="llama: rotary base frequency; 10000 if unset")
    rope_scaling: RopeScaling | None = Field(None, description="llama: Llama 3.1's frequency scaling")
    norm_eps: float | None = Field(None, gt=0, description="llama: RMSNorm's epsilon; 1e-5 if unset")
    qkv_bias: bool = Field(False, description="llama: biases on q, k and v (Qwen2)")
    o_bias: bool = Field(False, description="llama: a bias on the attention's output")
    mlp_bias: bool = Field(False, description="llama: biases in the MLP")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    @property
    def ffn_width(self) -> int:
        """GPT's 4·d_model; Llama's given width, or 8/3·d_model rounded up to a multiple of 64."""
        if self.family == "gpt":
            return 4 * self.d_model
        return self.ffn_dim or -(-8 * self.d_model // 3 // 64) * 64

    def param_count(self) -> int:
        """Parameters of this config's model, by arithmetic (no torch): embeddings, the blocks (attention, MLP,
        norms), the final norm, the head unless tied."""
        d = self.d_model
        ends = self.vocab_size * d * (1 if self.tie_weights else 2) + (
            self.seq_len * d if self.positions == "learned" else 0
        )
        return ends + self.n_layer * self.block_params() + (2 * d if self.family == "gpt" else d)

    def block_params(self, tp: int = 1) -> int:
        """One block's parameters, of one of `tp` tensor-parallel ranks: its linear layers split, its norms whole."""
        d = self.d_model
        if self.family == "gpt":  # attention 4·d², MLP 8·d², two LayerNorms
            return 12 * d * d // tp + 4 * d
        q, kv, f = self.n_head * self.head_width, self.kv_heads * self.head_width, self.ffn_width
        attention = d * (q + 2 * kv) + q * d + (q + 2 * kv) * self.qkv_bias
        mlp = 3 * d * f + 2 * f * self.mlp_bias
        return (attention + mlp) // tp + d * (self.o_bias + self.mlp_bias) + 2 * d

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """The model's linear layers by name, each (in, out) features: what LoRA's targets name."""
        d, f = self.d_model, self.ffn_width
        if self.family == "gpt":
            block = {"attn.q": (d, d), "attn.k": (d, d), "attn.v": (d, d), "attn.proj": (d, d)}
            block |= {"mlp.0": (d, f), "mlp.2": (f, d)}
        else:
            q, kv = self.n_head * self.head_width, self.kv_heads * self.head_width
            block = {"attn.q": (d, q), "attn.k": (d, kv), "attn.v": (d, kv), "attn.o": (q, d)}
            block |= {"mlp.gate": (d, f), "mlp.up": (d, f), "mlp.down": (f, d)}
        shapes = {f"blocks.{i}.{name}": shape for i in range(self.n_layer) for name, shape in block.items()}
        return shapes | {"head": (d, self.vocab_size)}

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.family == "gpt":
            if used := [k for k in LLAMA_ONLY if getattr(self, k) not in (None, False)]:
                raise ValueError(f"{', '.join('model.' + k for k in used)} apply to model.family=llama only")
            if self.d_model % self.n_head:
                raise ValueError(f"model.d_model={self.d_model} must be a multiple of model.n_head={self.n_head}")
        else:
            if self.positions != "rotary" or self.dropout:
                raise ValueError(
                    "model.family=llama has rotary positions and no dropout: leave out model.positions and "
                    "model.dropout"
                )
            if self.n_head % self.kv_heads:
                raise ValueError(f"model.n_kv_head={self.kv_heads} must divide model.n_head={self.n_head}")
            if self.head_dim is None and self.d_model % self.n_head:
                raise ValueError(
                    f"model.d_model={self.d_model} must be a multiple of model.n_head={self.n_head}, or set "
                    "model.head_dim"
                )
        if self.positions == "rotary" and self.head_width % 2:
            raise ValueError("rotary positions need an even head width (d_model / n_head, or model.head_dim)")
        return self


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


class DataConfig(Section):
    source: str = Field("embedded", description="'embedded' (stdlib corpus) or a manifest.json path/URI")
    cache_dir: str = Field("~/.cache/etrain/data", description="where the embedded corpus is built (path or URI)")
    corpus_bytes: int = Field(6_000_000, ge=10_000, description="cap on the embedded corpus' raw text")
    eval_fraction: float = Field(0.05, gt=0.0, lt=0.5, description="documents held out for evaluation")
    shard_bytes: int = Field(128 * 2**20, ge=4096, description="target physical shard size")
    cache_shards: int = Field(3, ge=2, description="shards each node keeps on local disk (the node cache)")
    shuffle_shards: int = Field(1, ge=1, description="shards whose samples are shuffled together; < cache_shards")
    node_cache_dir: str = Field("/tmp/etrain-cache", description="local directory of each node's shard cache")

    @model_validator(mode="after")
    def _room_to_prefetch(self) -> DataConfig:
        if self.shuffle_shards >= self.cache_shards:
            raise ValueError(
                f"data.shuffle_shards={self.shuffle_shards} must be below data.cache_shards={self.cache_shards}: "
                "the cache needs a free slot to prefetch the next shard"
            )
        return self


class TrainedTokenizer(Section):
    """A byte-level BPE learned by `etrain prepare` from the corpus it keeps (after the filters and dedup)."""

    train: Literal["bpe"] = "bpe"
    vocab_size: int = Field(ge=257, le=2**32, description="tokens, <|endoftext|> and the 256 bytes among them")
    sample_bytes: int = Field(100_000_000, ge=1, description="the corpus text it learns from, at most")


class PrepareConfig(Section):
    """`etrain prepare`: reading, quality filters and dedup. See etrain/data/quality.py."""

    tokenizer: str | TrainedTokenizer = Field(
        "bytes",
        description="bytes (every byte a token); a tokenizer.json or a directory holding one (a Hugging Face "
        "model's); or {train: bpe, vocab_size: N} to learn one from the corpus. Kept with the shards",
    )

    jsonl_field: str = Field("text", description="JSONL key holding a document's text")
    parquet_column: str = Field("text", description="Parquet column holding a document's text")
    min_words: int = Field(20, ge=1, description="shorter documents are rejected as too_short")
    max_symbol_ratio: float = Field(0.25, gt=0, le=1, description="non-letters among visible characters")
    min_mean_word_length: float = Field(2.5, gt=0)
    max_mean_word_length: float = Field(10.0, gt=0)
    max_repeated_line_ratio: float = Field(0.3, ge=0, le=1, description="lines repeating an earlier line")
    max_repeated_ngram_ratio: float = Field(0.2, ge=0, le=1, description="word n-grams repeating an earlier one")
    ngram: int = Field(5, ge=1, description="word n-gram size for the repetition filter and MinHash shingles")
    near_dup_threshold: float = Field(
        0.85, gt=0, le=1, description="MinHash Jaccard above which documents are near-duplicates"
    )
    minhash_perms: int = Field(128, ge=16)
    length_buckets: list[int] = Field(
        [2_000, 20_000], description="character counts splitting short/medium/long logical shards"
    )
    languages: list[str] = Field(
        [], description="ISO 639-1 codes of the languages kept, e.g. [en]; other documents are rejected as language"
    )
    language_min_share: float = Field(
        0.8, gt=0, le=1, description="share of a document's characters that must be in an allowed language"
    )

    @model_validator(mode="after")
    def _ordered(self) -> PrepareConfig:
        if self.min_mean_word_length >= self.max_mean_word_length:
            raise ValueError("prepare.min_mean_word_length must be below prepare.max_mean_word_length")
        if self.length_buckets != sorted(self.length_buckets) or len(self.length_buckets) != 2:
            raise ValueError("prepare.length_buckets must be two increasing character counts, e.g. [2000, 20000]")
        odd = [code for code in self.languages if not re.fullmatch(r"[a-z]{2,3}", code)]
        if odd:
            raise ValueError(f"prepare.languages takes ISO 639-1 codes such as en, de, zh; got {odd}")
        return self


class TrainConfig(Section):
    steps: int = Field(200, ge=1, description="optimizer steps in the whole run")
    global_batch: int = Field(16, ge=1, description="samples per optimizer step at cluster.num_workers workers")
    batch_scaling: Literal["constant", "linear"] = Field(
        "constant",
        description="constant: global_batch at any world size, so the loss trajectory does not depend on it; "
        "linear: global_batch / num_workers samples per worker, and lr scaled by the same factor (the linear scaling "
        "rule)",
    )
    micro_batch: int = Field(8, ge=1, description="samples per forward/backward; more are accumulated")
    seed: int = 0
    eval_every: int = Field(50, ge=0, description="steps between evaluations; 0 = only at the end")
    eval_samples: int = Field(64, ge=1, description="held-out sequences per evaluation")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="bf16 autocast (CPU or GPU); fp16 + GradScaler (GPU)"
    )
    outlier_sigmas: float = Field(
        3.0,
        ge=0,
        description="skip the update of a step whose gradient norm is above the running "
        "mean + this many standard deviations, and quarantine its samples; 0 disables",
    )
    outlier_warmup: int = Field(20, ge=2, description="accepted steps before the outlier guard starts judging")
    outlier_patience: int = Field(
        3, ge=1, description="outliers in a row that make the guard start over (a new regime)"
    )
    deterministic: bool = Field(
        False,
        description="bitwise-repeatable losses, also across a lost worker, a resize or a resume: an equal split of "
        "each step "
        "whatever the workers' speeds (balance.enabled=false) and torch's deterministic algorithms",
    )
    send_ahead: bool = Field(
        True,
        description="send the next step to the workers before this one's reports are back, where nothing but a step "
        "can follow (data parallelism at one rank a replica): the workers go on while the coordinator commits; a "
        "failure discards the step sent ahead, so every sample still counts once",
    )
    max_nan_rollbacks: int = Field(
        3,
        ge=0,
        description="a non-finite gradient rolls the run back to the last checkpoint with the lr halved, at most this "
        "many times; then the job fails",
    )


class OptimConfig(Section):
    name: Literal["adamw", "lamb"] = Field(
        "adamw",
        description="adamw: torch's; lamb: pytorch-optimizer's LAMB (Adam's step scaled per tensor by the trust "
        "ratio |w| / |step|, for large global batches)",
    )
    lr: float = Field(3e-3, gt=0)
    min_lr: float = Field(3e-4, ge=0)
    warmup_steps: int = Field(20, ge=0)
    schedule: Literal["cosine", "cosine_restarts"] = Field(
        "cosine",
        description="after the linear warm-up: cosine: one decay to min_lr over the run; cosine_restarts: torch's "
        "CosineAnnealingWarmRestarts (cycles of t_0 steps, each t_mult times the last, back to lr at each start)",
    )
    t_0: int = Field(100, ge=1, description="cosine_restarts: steps of the first cycle")
    t_mult: int = Field(1, ge=1, description="cosine_restarts: each cycle is this many times longer than the last")
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")


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
        "each membership change); None: 20% of train.steps, at least 2 (README, Gradient sync)",
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


class CheckpointConfig(Section):
    every: int = Field(
        50,
        ge=0,
        description="steps between full checkpoints (weights, optimizer, scheduler, scaler); 0 = only at the end",
    )
    light_every: int = Field(
        0,
        ge=0,
        description="steps between light checkpoints (changed weights only, in light_dtype; "
        "a resume from one takes the optimizer state of the last full one, so it is not exact); 0 = none",
    )
    light_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="dtype of a light checkpoint's weights"
    )
    async_save: bool = Field(
        True, description="write checkpoints in the background: a step waits only while the state is copied"
    )
    uri: str | None = Field(None, description="directory or URI; default RUN_DIR/checkpoints")
    keep: int = Field(3, ge=1, description="full checkpoints kept (and as many light ones after the newest)")
    every_s: float = Field(
        0,
        ge=0,
        description="also a full checkpoint once this many seconds have passed since the last one began (a wall-clock "
        "cadence beside `every`, for steps of uneven length); 0 = none",
    )


class ClusterConfig(Section):
    num_workers: int = Field(2, ge=1)
    cpus_per_worker: int = Field(1, ge=1, description="also torch's thread count per worker")
    gpus_per_worker: float = Field(0, ge=0, description="> 0 trains on CUDA with NCCL")
    address: str | None = Field(None, description="Ray address; default RAY_ADDRESS or a new local instance")
    warm_pool: int = Field(1, ge=0, description="built workers kept outside the group for joins and replacements")
    max_workers: int | None = Field(
        None,
        ge=1,
        description="autoscale: grow onto free cluster resources up to this many workers; None: stay at num_workers "
        "(or what `etrain scale` asks)",
    )
    max_recoveries: int = Field(3, ge=0, description="lost-worker recoveries before the job fails")
    min_workers: int = Field(
        1, ge=1, description="a health drain never leaves fewer members than this (it waits for a replacement)"
    )


class TimeoutConfig(Section):
    """Every wait of a run is bounded by one of these, so a dead or hung peer surfaces as an error, never a hang.
    The first three nest, innermost first.

    - collective_s (60): one all-reduce or barrier (the torch process group's timeout)
    - step_s (180): one whole step on every worker, collectives included; an evaluation; a save's staging
    - join_s (300): workers started, group formed, state loaded; the driver's wait for the coordinator's answer
    - ping_s (2): a live worker's answer to a ping: one that does not answer is taken for hung
    - connect_s (30): reaching the Ray cluster (a dead address, a refused token)
    - lease_s (60): a run's lease not renewed for this long is stale: another driver may take the run over
    - close_s (30): an ending run's last writes and cleanup (the cursor, the node caches), and a resumed run's wait
      for the old coordinator to go
    """

    collective_s: float = Field(60, gt=0)
    step_s: float = Field(180, gt=0)
    join_s: float = Field(300, gt=0)
    ping_s: float = Field(2, gt=0)
    connect_s: float = Field(30, gt=0)
    lease_s: float = Field(60, ge=4)
    close_s: float = Field(30, gt=0)

    @model_validator(mode="after")
    def _nested(self) -> TimeoutConfig:
        if not self.collective_s < self.step_s < self.join_s:
            raise ValueError(
                f"timeouts must nest: collective_s < step_s < join_s, got {self.collective_s} / {self.step_s} / "
                f"{self.join_s}"
            )
        if self.ping_s >= self.step_s:
            raise ValueError(
                f"timeouts.ping_s={self.ping_s} must be below timeouts.step_s={self.step_s}: a ping is a moment, a "
                "step is not"
            )
        return self


class Fault(Section):
    """Failure injection for tests and drills (control/faults.py): at `step` (1-based), worker `rank` dies (before its
    step, or inside the gradient all-reduce), hangs, slows down, computes a NaN loss, or a loss `factor` times too
    large. Three scenarios of a node that fails slowly (predictive maintenance, README "Node health"): `degrade`
    (its compute slows a little more each step, then it dies at `until`), `ecc` (its node reports single-bit ECC
    errors at a rising rate, then an uncorrectable one `warning` steps before it dies at `until`; the readings
    are synthetic and labelled so) and `noisy` (its compute time varies by up to `factor` times, every step, and
    it never fails: a node that must not be drained)."""

    rank: int = Field(ge=0)
    step: int = Field(ge=1)
    kind: Literal["kill", "kill_in_allreduce", "hang", "slow", "nan", "spike", "degrade", "ecc", "noisy", "link"] = (
        "kill"
    )
    factor: float = Field(
        2.0,
        ge=1,
        description="slow: compute takes this many times as long from `step` on (a straggler); degrade: "
        "compute takes 1 + (factor - 1) × (steps since `step`) times as long; noisy: up to this many times",
    )
    until: int | None = Field(None, ge=2, description="degrade, ecc: the step at which the rank's process dies")
    warning: int = Field(5, ge=0, description="ecc: steps between the uncorrectable error and the death")
    ready_pool: bool = Field(
        False,
        description="hold the fault from `step` until a warm-pool worker is ready: a drill of a recovery whose "
        "replacement is there (on a busy machine a pool worker may still be starting at `step`); the run's last "
        "step waits for one",
    )
    during: Literal["step", "eval"] = Field(
        "step",
        description="step: with the work of step `step`; eval: in the evaluation after step `step` (kill or hang)",
    )
    gbps: float | None = Field(
        None,
        gt=0,
        description="link: from `step` on, every rank's gradient collectives take the time a ring over a link of "
        "this many Gbit/s would need for the bytes they send (a simulation: etrain/worker/link.py); `rank` is ignored",
    )
    latency_ms: float = Field(0.0, ge=0, description="link: each hop of the ring adds this latency")

    @model_validator(mode="after")
    def _ends(self) -> Fault:
        if self.during == "eval" and (self.kind not in ("kill", "hang") or self.ready_pool):
            raise ValueError(f"a fault during an evaluation is a kill or a hang, without ready_pool; got {self.kind}")
        if self.kind in ("degrade", "ecc") and (self.until is None or self.until <= self.step):
            raise ValueError(f"a {self.kind} fault needs `until`, the step it dies at, after `step`={self.step}")
        if self.kind not in ("degrade", "ecc") and self.until is not None:
            raise ValueError(f"`until` applies to degrade and ecc faults, not {self.kind}")
        if (self.kind == "link") != (self.gbps is not None):
            raise ValueError(
                "a link fault needs `gbps`, the simulated link's bandwidth"
                if self.kind == "link"
                else f"`gbps` applies to link faults, not {self.kind}"
            )
        return self


class HealthConfig(Section):
    """Predictive maintenance (control/health_watch.py): each node's failure risk from its telemetry and its ranks'
    speed, and a drain of a node at risk at a step boundary, onto ready warm-pool workers elsewhere."""

    action: Literal["drain", "observe"] = Field(
        "drain", description="drain: move off a node whose risk reaches drain_at; observe: score and record only"
    )
    sources: list[Literal["nvml", "host"]] = Field(
        ["nvml", "host"],
        description="telemetry read on every node with workers: nvml (GPU: Xid, ECC, remapped rows, heat and "
        "throttling, PCIe replays), host (memory, swap); [] = the job's own signals only",
    )
    every_s: float = Field(5.0, gt=0, description="seconds between telemetry readings of a node")
    drain_at: float = Field(0.8, gt=0, le=1, description="a node's risk at which it is drained")
    persist: int = Field(3, ge=1, description="readings in a row a soft signal must hold to score in full")
    drift_steps: int = Field(8, ge=2, description="steps in a row a rank must run slower than its peers")
    drift_sigma: float = Field(
        4.0, gt=0, description="how far below its peers a rank's speed must be, in its own step-to-step noise"
    )
    drift_floor: float = Field(
        0.05, gt=0, description="the least noise assumed, as a log speed ratio (0.05: a rank 5% slower is noise)"
    )
    sbe_per_min: float = Field(10.0, gt=0, description="single-bit ECC errors per minute that count as rising")
    hot_c: float = Field(85.0, description="a GPU this hot and throttling for heat is a soft signal")
    mem_available_min: float = Field(
        0.05, ge=0, lt=1, description="host memory available below this share is a soft signal"
    )
    script: str | None = Field(
        None,
        description="a drill's telemetry: a JSONL file of readings, each with the `step` after which it is read and "
        "the `rank` whose node reports it (the node it is on at its first row), and any Reading field; replayed as "
        "synthetic readings",
    )
    cooldown_s: float = Field(600.0, ge=0, description="a drained node gets no new workers for this long")
    lemon_drains: int = Field(2, ge=1, description="a node drained this many times is listed as a lemon")


def targeted(name: str, targets: list[str]) -> bool:
    """Whether a module's name is, or ends in, one of `targets` (finetune.lora.targets, also_train)."""
    return any(name == t or name.endswith("." + t) for t in targets)


class LoraConfig(Section):
    rank: int = Field(8, ge=1, description="rank of each adapter's update B A")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: list[str] = Field(
        ["attn.q", "attn.k", "attn.v", "attn.proj"],
        min_length=1,
        description="linear layers that get adapters, by name or its end: attn.q, attn.k, attn.v, attn.proj, mlp.0, "
        "mlp.2 (in every block), blocks.0.attn.q (one), head; Llama's: attn.o, mlp.gate, mlp.up, mlp.down (its "
        "default: attn.q, attn.k, attn.v, attn.o)",
    )
    also_train: list[str] = Field(
        [],
        description="modules trained in full beside the adapters, by name or its end (norm1, norm2, norm: the "
        "LayerNorms); their weights are checkpointed with the adapters",
    )


class FinetuneConfig(Section):
    """Training that starts from a trained model (`etrain finetune --from`): its weights, then LoRA adapters on them
    (only the adapters train) or all of them."""

    base: str | None = Field(None, description="the checkpoint the run starts from (set by etrain finetune)")
    base_digest: str | None = Field(
        None,
        description="sha256 over the base's weights, taken when the run was made: a base that no longer matches "
        "is refused",
    )
    method: Literal["lora", "full"] = Field("lora", description="lora: adapters only; full: every weight trains")
    lora: LoraConfig = LoraConfig()

    @model_validator(mode="after")
    def _digest_with_base(self) -> FinetuneConfig:
        if self.base is not None and self.base_digest is None:
            raise ValueError(
                "finetune.base needs finetune.base_digest; start fine-tuning runs with `etrain finetune --from`, "
                "which records it"
            )
        return self

    @property
    def lora_on(self) -> bool:
        return self.base is not None and self.method == "lora"


class PPOConfig(Section):
    """Reinforcement learning from a reward (`etrain ppo`): the policy (the fine-tuned model, with a value head)
    samples responses to the reward task's prompts, the reward scores them, and PPO updates the policy with a
    per-token KL penalty against the frozen base. See etrain/core/ppo.py."""

    reward: str | None = Field(
        None, description="a built-in task (digits, brackets, length) or FILE.py:function; set by etrain ppo"
    )
    prompt_len: int = Field(16, ge=1, description="prompts are cut or left-padded (with the separator) to this")
    response_len: int = Field(24, ge=1, description="tokens sampled per response (a separator ends one early)")
    rollouts: int = Field(32, ge=1, description="responses per PPO step, over all workers")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts and evaluations")
    epochs: int = Field(2, ge=1, description="passes of PPO updates over each step's rollouts")
    minibatches: int = Field(2, ge=1, description="updates per pass (each worker splits its rollouts as many ways)")
    clip: float = Field(0.2, gt=0, description="the policy ratio's clip range")
    value_clip: float = Field(0.2, gt=0, description="the value's clip range around the rollout's")
    value_coef: float = Field(0.1, ge=0, description="weight of the value loss beside the policy loss")
    gamma: float = Field(1.0, gt=0, le=1, description="the discount over a response's tokens")
    lam: float = Field(0.95, ge=0, le=1, description="GAE's lambda")
    kl_coef: float = Field(0.05, ge=0, description="the KL penalty's initial coefficient (beta)")
    kl_target: float = Field(6.0, gt=0, description="the per-response KL (nats) the controller holds")
    kl_horizon: int = Field(10_000, ge=1, description="responses over which beta adapts (Ziegler et al.)")
    kl_gain: float = Field(
        4.0,
        ge=0,
        description="a step whose rollouts' KL is above kl_target applies beta × (KL / kl_target)^kl_gain: an "
        "overshoot is met in the step that shows it; 0 = Ziegler's slow law alone",
    )
    eval_prompts: int = Field(64, ge=1, description="held-out prompts whose mean reward each evaluation measures")
    reward_timeout_s: float | None = Field(
        None,
        gt=0,
        description="the most a worker waits for the reward to score its responses (one call at a time serves every "
        "worker); a reward slower than this fails the run naming it; below timeouts.step_s (None: half of it)",
    )


class RunConfig(Section):
    root: str = Field("runs", description="parent directory of run directories")
    name: str | None = Field(
        None, description="run directory name, one name inside run.root (any language); default a timestamp"
    )

    @field_validator("name")
    @classmethod
    def _one_name(cls, name: str | None) -> str | None:
        """The run's directory inside run.root, never outside it (../x) or the root itself (.)."""
        if name is None:
            return name
        if name in ("", ".", "..") or any(c in name for c in "/\\") or not name.isprintable():
            raise ValueError(
                "must be one directory name inside run.root (no / or \\, not . or .., no control characters)"
            )
        if len(name.encode()) > 255:
            raise ValueError(f"is {len(name.encode())} bytes long; a directory name takes at most 255")
        return name


class Config(Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    prepare: PrepareConfig = PrepareConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    comm: CommConfig = CommConfig()
    balance: BalanceConfig = BalanceConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    cluster: ClusterConfig = ClusterConfig()
    parallel: ParallelConfig = ParallelConfig()
    finetune: FinetuneConfig = FinetuneConfig()
    ppo: PPOConfig = PPOConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    health: HealthConfig = HealthConfig()
    run: RunConfig = RunConfig()
    faults: list[Fault] = Field([], description="injected failures (testing); see Fault")

    @model_validator(mode="before")
    @classmethod
    def _llama_lora_targets(cls, raw: Any) -> Any:
        """LoRA's default targets are the attention's projections of the model's family: Llama's output projection
        is attn.o, GPT's attn.proj."""
        if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict) or raw["model"].get("family") != "llama":
            return raw
        finetune = dict(raw.get("finetune") or {})
        lora = dict(finetune.get("lora") or {})
        if "targets" not in lora:
            lora["targets"] = ["attn.q", "attn.k", "attn.v", "attn.o"]
        return raw | {"finetune": finetune | {"lora": lora}}

    @model_validator(mode="before")
    @classmethod
    def _deterministic_split(cls, raw: Any) -> Any:
        """train.deterministic means an equal split: balance.enabled follows it, and saying otherwise is an error."""
        if not isinstance(raw, dict) or (raw.get("train") or {}).get("deterministic") is not True:
            return raw
        balance = raw.get("balance") or {}
        if balance.get("enabled") is True:
            raise ValueError(
                "train.deterministic=true splits every step equally: it needs balance.enabled=false (or leave it out)"
            )
        return {**raw, "balance": {**balance, "enabled": False}}

    @model_validator(mode="after")
    def _cross_section(self) -> Config:
        if self.train.precision == "fp16" and self.cluster.gpus_per_worker == 0:
            raise ValueError("train.precision=fp16 needs a GPU (cluster.gpus_per_worker > 0); use bf16 on CPU")
        if self.train.global_batch < self.cluster.num_workers:
            raise ValueError(
                f"train.global_batch={self.train.global_batch} is smaller than "
                f"cluster.num_workers={self.cluster.num_workers}: every worker needs a sample"
            )
        if self.cluster.min_workers > self.cluster.num_workers:
            raise ValueError(
                f"cluster.min_workers={self.cluster.min_workers} is above "
                f"cluster.num_workers={self.cluster.num_workers}"
            )
        if self.cluster.max_workers is not None and self.cluster.max_workers < self.cluster.num_workers:
            raise ValueError(
                f"cluster.max_workers={self.cluster.max_workers} is below "
                f"cluster.num_workers={self.cluster.num_workers}"
            )
        if (self.cluster.max_workers or 0) > self.train.global_batch and self.train.batch_scaling == "constant":
            raise ValueError(
                f"cluster.max_workers={self.cluster.max_workers} exceeds train.global_batch={self.train.global_batch}: "
                "every worker needs a sample"
            )
        if self.comm.mode == "ps" and (self.comm.zero or self.comm.compression != "none"):
            raise ValueError(
                "comm.mode=ps sends whole gradients to the parameter servers: comm.zero and comm.compression apply to "
                "allreduce only"
            )
        if self.comm.mode == "ps" and (self.optim.name != "adamw" or self.checkpoint.every_s):
            raise ValueError(
                "comm.mode=ps runs AdamW on its shards and checkpoints at its quiet steps (checkpoint.every): "
                "optim.name=lamb and checkpoint.every_s apply to allreduce only"
            )
        if self.ppo.reward is not None:
            self._check_ppo()
        if self.comm.mode == "ps" and self.finetune.lora_on:
            raise ValueError(
                "finetune.method=lora trains adapters on frozen weights; comm.mode=ps shards every weight: use "
                "comm.mode=allreduce"
            )
        if self.finetune.lora_on:
            self._check_lora_rank()
        if self.finetune.lora_on and self.model.tie_weights and "head" in self.finetune.lora.targets:
            raise ValueError(
                "finetune.lora.targets has head, whose weight is the embedding's (model.tie_weights): an adapter "
                "there would untie them when merged; leave head out"
            )
        if self.comm.mode == "ps" and self.train.deterministic:
            raise ValueError(
                "comm.mode=ps is not repeatable (which update a gradient lands in depends on timing): it cannot be "
                "train.deterministic"
            )
        if self.comm.mode == "ps" and (self.train.batch_scaling == "linear" or self.train.precision == "fp16"):
            raise ValueError(
                "comm.mode=ps needs train.batch_scaling=constant (a step is one global batch) and no fp16 (the shards "
                "have no loss scaler): use bf16"
            )
        if self.comm.mode == "diloco":
            self._check_diloco()
        if any(f.kind == "link" for f in self.faults) and (
            self.comm.mode == "ps" or self.parallel.ranks > 1 or self.ppo.reward
        ):
            raise ValueError(
                "a link fault models the gradient all-reduce of data parallelism and DiLoCo; comm.mode=ps, "
                "parallel layouts and PPO (ppo.reward) send theirs another way: leave the link fault out"
            )
        for fault in (f for f in self.faults if f.kind == "link"):
            self._check_link(fault)
        if self.comm.zero and self.checkpoint.every == 0:
            raise ValueError(
                "comm.zero needs checkpoint.every > 0: a lost worker takes its optimizer shard along, and the job goes "
                "back to the last checkpoint"
            )
        if self.comm.mode == "ps" and self.train.global_batch % self.cluster.num_workers:
            raise ValueError(
                f"comm.mode=ps gives each worker train.global_batch / cluster.num_workers samples per push: "
                f"make train.global_batch={self.train.global_batch} a multiple of "
                f"cluster.num_workers={self.cluster.num_workers}"
            )
        largest = max(self.cluster.num_workers, self.cluster.max_workers or 0)
        every = self.train.eval_every
        for i, fault in enumerate(self.faults):
            evaluated = fault.step == self.train.steps or (every > 0 and fault.step % every == 0)
            if fault.during == "eval" and not evaluated:
                raise ValueError(
                    f"faults[{i}] (during: eval) never fires: step {fault.step} is followed by no evaluation "
                    f"(train.eval_every={every}, train.steps={self.train.steps})"
                )
            if fault.rank >= largest:
                raise ValueError(
                    f"faults[{i}].rank={fault.rank} never fires: the run has at most {largest} worker(s) "
                    f"(ranks 0-{largest - 1}; cluster.num_workers, cluster.max_workers)"
                )
        if self.train.batch_scaling == "linear" and self.train.global_batch % self.cluster.num_workers:
            raise ValueError(
                f"train.batch_scaling=linear needs train.global_batch={self.train.global_batch} to be a multiple of "
                f"cluster.num_workers={self.cluster.num_workers} (it is the per-worker batch times the workers)"
            )
        return self

    def _check_link(self, fault: Fault) -> None:
        """A link so slow that a step's gradient all-reduce alone outlasts timeouts.step_s: every step would time
        out and the run end as if every worker were lost. Dense gradients at the largest world (fp16/bf16 halve
        them; top-k and PowerSGD send dense ones first), DDP's buckets each paying the ring's latency."""
        world = max(self.cluster.num_workers, self.cluster.max_workers or 0)
        trained = self.lora_params() if self.finetune.lora_on else self.model.param_count()
        grad_bytes = trained * (2 if self.comm.compression in ("fp16", "bf16") else 4)
        sync = gradient_sync_s(grad_bytes, self.comm.bucket_mb, world, fault.gbps, fault.latency_ms)
        if sync >= self.timeouts.step_s:
            raise ValueError(
                f"faults: a link of {fault.gbps:g} Gbit/s and {fault.latency_ms:g} ms a hop makes a step's gradient "
                f"all-reduce ({grad_bytes / 2**20:,.1f} MiB among {world} workers) take about {sync:,.1f} s by the "
                f"ring model, at least timeouts.step_s={self.timeouts.step_s:g}: every step would time out. Raise "
                f"timeouts.step_s above {2 * sync + 1:,.0f} (timeouts.join_s above that), or simulate a faster link"
            )

    def _check_diloco(self) -> None:
        refused = {
            "comm.zero": self.comm.zero,
            f"comm.compression={self.comm.compression}": self.comm.compression != "none",
            "train.batch_scaling=linear": self.train.batch_scaling == "linear",
            "PPO (ppo.reward)": bool(self.ppo.reward),
        }
        if used := [name for name, on in refused.items() if on]:
            raise ValueError(
                f"comm.mode=diloco does not support {', '.join(used)}: its workers sync no gradients (only the "
                "pseudo-gradient of each outer step, comm.diloco.bf16 to halve it), keep their whole optimizer "
                "state, and take fixed shares of a fixed batch; leave them out"
            )

    def compress_start(self) -> int:
        """Steps of plain all-reduce before top-k or PowerSGD compress: comm.compress_start, or 20% of the run (1-bit
        Adam's 15-25%: early gradients change fast, and what compression holds back then arrives stale)."""
        start = self.comm.compress_start
        return start if start is not None else max(2, round(0.2 * self.train.steps))

    @property
    def window(self) -> int:
        """Steps from one outer step to the next: DiLoCo's inner steps; 1 in the other modes."""
        return self.comm.diloco.inner_steps if self.comm.mode == "diloco" else 1

    def outer_step(self, step: int) -> bool:
        """Whether `step` ends a window (every step does outside DiLoCo): the workers then hold one model, which is
        what evaluations and checkpoints see and where membership changes land."""
        return step % self.window == 0 or step == self.train.steps

    def _check_lora_rank(self) -> None:
        lora, shapes = self.finetune.lora, self.model.linear_shapes()
        narrowest = min((min(s) for n, s in shapes.items() if targeted(n, lora.targets)), default=None)
        if narrowest is not None and lora.rank > narrowest:
            raise ValueError(
                f"finetune.lora.rank={lora.rank} exceeds {narrowest}, the narrowest side of a layer it adapts: an "
                f"update B·A of that layer has rank {narrowest} at most, so a larger rank only adds weights (for a "
                "full-rank update, finetune.method=full costs less)"
            )

    def lora_params(self) -> int:
        """Parameters of the LoRA adapters this config puts on the model (0 without LoRA)."""
        if not self.finetune.lora_on:
            return 0
        lora = self.finetune.lora
        return sum(lora.rank * (i + o) for n, (i, o) in self.model.linear_shapes().items() if targeted(n, lora.targets))

    def _check_ppo(self) -> None:
        ppo = self.ppo
        if self.finetune.base is None:
            raise ValueError("ppo.reward trains a trained model: start PPO runs with `etrain ppo --from RUN`")
        refused = {
            "comm.mode=ps": self.comm.mode == "ps",
            f"comm.compression={self.comm.compression}": self.comm.compression in ("topk", "powersgd"),
            "train.precision=fp16": self.train.precision == "fp16",
            "train.batch_scaling=linear": self.train.batch_scaling == "linear",
            "parallel.tp × parallel.pp × parallel.shard > 1": self.parallel.ranks > 1,
            "faults of kind slow, nan, spike, degrade or noisy": any(
                f.kind in ("slow", "nan", "spike", "degrade", "noisy") for f in self.faults
            ),
        }
        if used := [name for name, on in refused.items() if on]:
            raise ValueError(
                f"ppo.reward (a PPO run) does not support {', '.join(used)}: several updates per step share one "
                "rollout, which these do not allow for; leave them out"
            )
        if self.checkpoint.every == 0:
            raise ValueError(
                "ppo.reward (a PPO run) needs checkpoint.every > 0: a worker lost in a PPO step sends the run back to "
                "its last checkpoint (the survivors may have made some of the step's updates)"
            )
        if ppo.reward_timeout_s is not None and ppo.reward_timeout_s >= self.timeouts.step_s:
            raise ValueError(
                f"ppo.reward_timeout_s={ppo.reward_timeout_s:g} must be below "
                f"timeouts.step_s={self.timeouts.step_s:g}: a step waits for its scores"
            )
        most = max(self.cluster.num_workers, self.cluster.max_workers or 0)
        if ppo.rollouts < most * ppo.minibatches:
            raise ValueError(
                f"ppo.rollouts={ppo.rollouts} is below {most} worker(s) × ppo.minibatches={ppo.minibatches}: every "
                "worker needs a rollout for each of its updates"
            )
        if ppo.prompt_len + ppo.response_len > self.model.seq_len:
            raise ValueError(
                f"ppo.prompt_len + ppo.response_len = {ppo.prompt_len + ppo.response_len} exceeds "
                f"model.seq_len={self.model.seq_len}"
            )

    @model_validator(mode="after")
    def _layout(self) -> Config:
        """What a tp × pp × shard replica needs of the model and the batch, and what it does not support yet, by
        name."""
        par, m = self.parallel, self.model
        if par.ranks == 1:
            return self
        if m.n_head % par.tp or m.kv_heads % par.tp:
            raise ValueError(
                f"parallel.tp={par.tp} must divide model.n_head={m.n_head} and its key/value heads ({m.kv_heads}): "
                "each tensor-parallel rank holds whole heads"
            )
        if m.n_layer < par.pp:
            raise ValueError(f"parallel.pp={par.pp} exceeds model.n_layer={m.n_layer}: every stage needs a block")
        if par.pp > 1 and par.shard > 1:
            raise ValueError(
                f"parallel.pp={par.pp} with parallel.shard={par.shard} is not supported yet: a pipeline stage's "
                "parameters are not sharded; use parallel.tp with parallel.shard, or parallel.pp alone"
            )
        if par.ranks > 1 and self.checkpoint.light_every:
            raise ValueError(
                f"checkpoint.light_every={self.checkpoint.light_every} with parallel.tp × parallel.pp × "
                f"parallel.shard = {par.ranks} is not supported: a laid-out run's checkpoints are full ones, each rank "
                "writing the tensors it holds (torch DCP, in the background); set checkpoint.light_every=0"
            )
        if par.pp > 1 and par.microbatches < par.pp:
            raise ValueError(
                f"parallel.microbatches={par.microbatches} is below parallel.pp={par.pp}: the pipeline never fills"
            )
        for key, workers in (("num_workers", self.cluster.num_workers), ("max_workers", self.cluster.max_workers)):
            if workers and (why := par.misfit(workers, self.train.global_batch, f"cluster.{key}={workers}")):
                raise ValueError(why)
        unsupported = {
            "comm.mode=ps": self.comm.mode == "ps",
            "comm.zero": self.comm.zero,
            f"comm.compression={self.comm.compression}": self.comm.compression != "none",
            "train.precision=fp16": self.train.precision == "fp16",
            "train.batch_scaling=linear": self.train.batch_scaling == "linear",
            # its trust ratio needs each tensor's whole norm, and a laid-out rank holds a slice of some
            "optim.name=lamb": self.optim.name == "lamb",
            "finetune.method=lora": self.finetune.lora_on,
            "PPO (ppo.reward)": bool(self.ppo.reward),  # its rollouts and updates are data-parallel's
            "comm.mode=diloco": self.comm.mode == "diloco",
        }
        refused = [name for name, used in unsupported.items() if used]
        if refused:
            raise ValueError(
                f"{', '.join(refused)} with parallel.tp × parallel.pp × parallel.shard > 1 is not supported yet; "
                "leave it out, or train with parallel.tp=1 parallel.pp=1 parallel.shard=1"
            )
        return self

    def reward_timeout_s(self) -> float:
        """How long a PPO worker waits for its scores: ppo.reward_timeout_s, or half a step."""
        return self.ppo.reward_timeout_s or self.timeouts.step_s / 2

    def worker_memory(self) -> int:
        """About the bytes one worker (one rank) needs: the sum of rank_memory."""
        return sum(self.rank_memory().values())

    def rank_memory(self) -> dict[str, int]:
        """About the bytes one rank holds, by part, in this run's layout (the fullest rank: the first stage, which
        holds the embedding).

        weights, gradients and optimizer: fp32, AdamW's two moments (16 bytes per parameter; with LoRA, 4 per
        frozen weight and 16 per adapter parameter); a block's tensors split over parallel.tp, the blocks over
        parallel.pp's stages, everything over parallel.shard (FSDP2), AdamW's state over the workers with ZeRO-1;
        DiLoCo adds the outer parameters and momentum (8 bytes per trained parameter) to the optimizer's part.
        activations: one micro-batch's kept for backward (Korthikanti et al. 2022, per layer 10·s·b·h + 24·s·b·h/t
        + 5·a·s²·b/t bytes at 16 bits, twice that in fp32; the s² term is an upper bound: fused attention keeps no
        scores), and the logits and their gradient. gathered: the whole parameters of the block FSDP computes and of
        the next it prefetches, in the precision they compute in."""
        m, par, b = self.model, self.parallel, self.train.micro_batch
        width = 2 if self.train.precision == "fp32" else 1
        d, s, layers = m.d_model, m.seq_len, math.ceil(m.n_layer / par.pp)
        block = m.block_params(par.tp)
        params = (m.param_count() - m.n_layer * m.block_params()) + layers * block  # the ends whole: the fullest
        if self.finetune.lora_on:
            trained = self.lora_params()
            weights, gradients, optimizer = 4 * (params + trained), 4 * trained, 8 * trained
        else:
            weights, gradients, optimizer = 4 * params, 4 * params, 8 * params
        weights, gradients, optimizer = (x // par.shard for x in (weights, gradients, optimizer))
        if self.comm.zero:
            optimizer //= max(self.cluster.num_workers, 1)
        if self.comm.mode == "diloco":  # the outer parameters and their momentum, beside the inner optimizer's
            optimizer += 8 * (self.lora_params() if self.finetune.lora_on else params)
        per_layer = (10 * s * b * d + 24 * s * b * d // par.tp + 5 * m.n_head * s * s * b // par.tp) * width
        activations = layers * per_layer + 8 * b * s * m.vocab_size
        gathered = 2 * block * (2 if self.train.precision == "bf16" else 4) if par.shard > 1 else 0
        return {
            "weights": weights,
            "gradients": gradients,
            "optimizer": optimizer,
            "activations": activations,
            "gathered": gathered,
        }

    def batch_at(self, world: int) -> int:
        """Samples per optimizer step with `world` workers."""
        if self.train.batch_scaling == "constant":
            return self.train.global_batch
        return self.train.global_batch // self.cluster.num_workers * world

    def most_per_step(self) -> int:
        """The most samples one step can take: a PPO step's rollouts, the global batch, or with
        train.batch_scaling=linear the batch of 65,536 workers (no group is larger). A checkpoint's cursor is held to
        its steps times this: a cursor beyond it was not written by a run of this config."""
        if self.ppo.reward is not None:
            return self.ppo.rollouts
        return self.train.global_batch if self.train.batch_scaling == "constant" else self.batch_at(65536)

    def hash(self) -> str:
        """Identity of what is trained: everything but the RESUMABLE keys."""
        body = self.model_dump()
        if self.model.family == "gpt":  # a GPT run's identity is what it was before the Llama family's keys came
            for key in ("family", *LLAMA_ONLY):
                body["model"].pop(key)
        for key in RESUMABLE:
            section, _, leaf = key.partition(".")
            body[section].pop(leaf) if leaf else body.pop(section)
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


def load_config(config: str | dict | None = None, overrides: list[str] = ()) -> Config:
    """Preset name, YAML file or a config's raw dict, then `a.b=value` overrides, then validation."""
    raw = raw_config(config)
    for item in overrides:
        key, value = _parse_override(item)
        _set_path(raw, key, value)
    return validate(raw)


def raw_config(config: str | dict | None) -> dict:
    """A preset's, a YAML file's or a raw dict's keys as given (a copy), before defaults and validation."""
    return copy.deepcopy(config) if isinstance(config, dict) else _read_yaml(resolve_preset(config)) if config else {}


def override(cfg: Config, values: dict[str, Any]) -> Config:
    """`cfg` with dotted keys set (a trial's parameters), validated again."""
    raw = cfg.model_dump()
    for key, value in values.items():
        _set_path(raw, key, value)
    return validate(raw)


def resolve_preset(config: str) -> Path:
    path = Path(config)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {config!r} does not exist")
        return path
    preset = PRESET_DIR / f"{config}.yaml"
    if preset.is_file():
        return preset
    names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    raise ConfigError(
        f"no config file or preset named {config!r}{_did_you_mean(config, names)}; presets: {', '.join(names)}"
    )


def validate(raw: dict[str, Any]) -> Config:
    _check_keys(raw, Config, "")
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, train:, ...)")
    return data


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=100)")
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def _set_path(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {'.'.join(parents[: i + 1])} is a value, not a section")
        node = child
    node[leaf] = value


def _check_keys(raw: Any, model: type[BaseModel], prefix: str) -> None:
    """Unknown keys anywhere in the tree, with a did-you-mean."""
    if not isinstance(raw, dict):
        return
    fields = model.model_fields
    for key, value in raw.items():
        where = f"{prefix}{key}"
        if key not in fields:
            known = list(fields)
            raise ConfigError(
                f"unknown config key {where!r}{_did_you_mean(str(key), known, prefix)}; allowed here: "
                f"{', '.join(known)}"
            )
        sub = fields[key].annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {where!r} is a section; give its keys ({', '.join(sub.model_fields)})")
            _check_keys(value, sub, f"{where}.")


def _format_errors(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        key = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], (dict, list)) else ""
        lines.append(f"config key {key!r}: {message}{got}" if key else f"config: {message}")
    return "\n".join(lines)


def _did_you_mean(word: str, choices: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""
