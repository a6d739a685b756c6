"""What one step does and how often (train: steps, batch, precision, evaluation, the guards) and the optimizer
with its learning-rate schedule (optim)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from etrain.core.config.base import Section


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
