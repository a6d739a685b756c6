"""The optimizer (AdamW, or LAMB for large batches) with decoupled weight decay on matrices only, and the lr
schedule: a linear warm-up, then one cosine decay or cosine cycles with warm restarts."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from etrain.core.config import OptimConfig
from etrain.core.models import make_model


def make_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    return optimizer_class(cfg)(make_param_groups(model, cfg), **optimizer_defaults(cfg))


def optimizer_class(cfg: OptimConfig) -> type[torch.optim.Optimizer]:
    if cfg.name == "lamb":
        from pytorch_optimizer import Lamb  # ~0.5 s to import: optim.name=lamb only

        return Lamb
    return torch.optim.AdamW


def optimizer_defaults(cfg: OptimConfig) -> dict:
    """What the optimizer is built with besides its param groups (ZeRO-1 passes the same to each shard's)."""
    defaults = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2)}
    # LAMB: decoupled decay as AdamW's; no gradient rescaling of its own (train.grad_clip clips), and no foreach path:
    # it stacks the step's per-tensor norms, which a ZeRO-1 shard's empty group could not
    return defaults | ({"max_grad_norm": 0.0, "foreach": False} if cfg.name == "lamb" else {})


def make_param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    # Norm gains and biases are not decayed: shrinking them only hurts (nanoGPT, GPT-2). Frozen weights (a LoRA
    # run's base) have no optimizer state at all.
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of cfg.lr at `step`: linear warmup, then cosine down to min_lr, once or in cycles."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr / cfg.lr
    if cfg.schedule == "cosine_restarts":
        t_cur, t_i = restart_position(step - cfg.warmup_steps, cfg.t_0, cfg.t_mult)
        return floor + (1 - floor) * (1 + math.cos(math.pi * t_cur / t_i)) / 2
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def restart_position(steps: int, t_0: int, t_mult: int) -> tuple[int, int]:
    """(steps into the current cycle, its length) `steps` after the warm-up: what torch's
    CosineAnnealingWarmRestarts holds as T_cur and T_i after as many step() calls. In integers: torch's
    closed form for step(epoch) takes a float log, which lands a step early or late at some cycles' edges."""
    if t_mult == 1:
        return steps % t_0, t_0
    t_i = t_0
    while steps >= t_i:
        steps, t_i = steps - t_i, t_i * t_mult
    return steps, t_i


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, cfg=cfg, total_steps=total_steps))


def whole_groups(model_cfg, optim_cfg) -> list[list[str]]:
    """The whole model's parameter names in its optimizer's param groups (make_param_groups'): how a checkpoint's
    optimizer state indexes its tensors, in any layout."""
    with torch.device("meta"):
        model = make_model(model_cfg)
    name = {id(p): n for n, p in model.named_parameters()}
    return [[name[id(p)] for p in g["params"]] for g in make_param_groups(model, optim_cfg)]


def as_optimizer_state(optim: dict, groups: list[dict], names: list[list[str]]) -> dict:
    """AdamW state by whole-model parameter name (a layout's DCP checkpoint read whole, or layout_state.full_state's)
    as the whole model's optimizer state_dict, the form a data-parallel run loads; `groups`: the param groups whose
    hyper-parameters it keeps."""
    flat = [n for group in names for n in group]
    param_groups, start = [], 0
    for group, members in zip(groups, names):
        hyper = {k: v for k, v in group.items() if k != "params"}
        param_groups.append(hyper | {"params": list(range(start, start + len(members)))})
        start += len(members)
    return {"state": {flat.index(n): st for n, st in optim.items()}, "param_groups": param_groups}


def by_name(optimizer_state: dict, names: list[list[str]]) -> dict:
    """A whole model's optimizer state_dict as AdamW state by parameter name (load_full's form)."""
    flat = [n for group in names for n in group]
    return {flat[i]: st for i, st in optimizer_state["state"].items()}
