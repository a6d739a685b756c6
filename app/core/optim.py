"""AdamW with decoupled weight decay on matrices only, and warmup + cosine LR."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from app.core.config import OptimConfig


def make_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(make_param_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def make_param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    # Norm gains and biases are not decayed: shrinking them only hurts (nanoGPT, GPT-2).
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of cfg.lr at `step`: linear warmup, then cosine down to min_lr."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr / cfg.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, cfg=cfg, total_steps=total_steps))
