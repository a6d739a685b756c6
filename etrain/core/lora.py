"""LoRA adapters on the GPT's linear layers, and their merge into plain weights.

As torchtune's LoRALinear: A kaiming-initialised, B zero (so training starts from the base model exactly), the
update scaled by alpha / rank. The adapted layer keeps `weight` under its name, so a base checkpoint loads into it
as into the nn.Linear it replaces. The adapters (and what finetune.lora.also_train names) are the model's only
trainable parameters: only they are all-reduced, compressed, sharded and checkpointed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from etrain.core.config import LoraConfig, targeted

ADAPTERS = ("lora_a", "lora_b")


class LoRALinear(nn.Linear):
    """y = x Wᵀ + b + (alpha / rank) · B A drop(x), with W and b frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias  # the base's own tensors: nothing copied
        self.scale = alpha / rank
        self.drop = nn.Dropout(dropout)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # nn.Linear's own init, as torchtune and peft

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.drop(x), self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype))
        return F.linear(x, self.weight, self.bias) + self.scale * update

    def merged_weight(self) -> torch.Tensor:
        return (self.weight + self.scale * self.lora_b @ self.lora_a).detach()


def add_adapters(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Freeze `model` and put an adapter on each linear layer whose name is, or ends in, one of cfg.targets.
    The names adapted, in order. A target that names no linear layer is an error that lists the ones there are."""
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    chosen = {t: [n for n in linear if targeted(n, [t])] for t in cfg.targets}
    if missing := [t for t, names in chosen.items() if not names]:
        kinds = sorted({n.split(".", 2)[-1] if n.startswith("blocks.") else n for n in linear})
        raise ValueError(
            f"finetune.lora.targets {missing} name no linear layer of this model; its linear layers: {kinds}"
        )
    modules = [name for name, _ in model.named_modules() if name]
    also = {t: [n for n in modules if targeted(n, [t])] for t in cfg.also_train}
    if missing := [t for t, names in also.items() if not names]:
        raise ValueError(f"finetune.lora.also_train {missing} name no module of this model")
    for name, p in model.named_parameters():
        p.requires_grad_(any(name.startswith(m + ".") for found in also.values() for m in found))
    names = [n for n in linear if any(n in found for found in chosen.values())]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, LoRALinear(getattr(owner, leaf), cfg.rank, cfg.alpha, cfg.dropout))
    return names


def is_adapter(name: str) -> bool:
    return name.rpartition(".")[2] in ADAPTERS


def adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if is_adapter(n)}


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters a LoRA model trains: its adapters and what finetune.lora.also_train names."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the plain model: every adapted weight with its update folded in, the adapters gone."""
    state = {n: t.detach().clone() for n, t in model.state_dict().items() if not is_adapter(n)}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            state[f"{name}.weight"] = m.merged_weight().clone()
    return state
