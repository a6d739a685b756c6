"""What a model family provides, as one object its folder defines (etrain/core/models/<name>/__init__.py): the
torch module to build, the shape arithmetic the config and the memory model need without torch, the tensor-parallel
plan, LoRA's default targets, the FLOPs a token costs, its presets and, where it has one, its Hugging Face format.
torchtitan's TrainSpec is the model: everything that differs between families is here, so the trainer names none.

No torch at import: the config reads the arithmetic on the driver and the coordinator, which never build a model."""

from __future__ import annotations

import re
from importlib import import_module
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from torch import nn

    from etrain.core.config import ModelConfig


class HFFormat:
    """A family's Hugging Face format: the `architectures` of config.json it reads, its tensors' names (per layer,
    `model.layers.N.<name>`, and outside the layers) and its config.json both ways."""

    architectures: ClassVar[tuple[str, ...]]
    block: ClassVar[dict[str, str]]  # their name in a layer -> ours in a block
    outside: ClassVar[dict[str, str]]  # their module -> ours

    def read_config(self, config: dict, path: str, architecture: str) -> ModelConfig:
        """The model section of a config.json of one of `architectures` (KeyError for a missing key, ConfigError
        for what is not supported)."""
        raise NotImplementedError

    def write_config(self, cfg: ModelConfig) -> dict:
        """config.json for `cfg`, less its dtype (the writer adds that of the tensors)."""
        raise NotImplementedError

    def our_name(self, name: str) -> str | None:
        """A Hugging Face tensor's name in our model; None for what it does not hold (rotary tables some files
        keep)."""
        if m := re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name):
            part = self.block.get(m[2])
            return f"blocks.{m[1]}.{part}.{m[3]}" if part else None
        module, _, kind = name.rpartition(".")
        return f"{self.outside[module]}.{kind}" if module in self.outside else None

    def their_name(self, name: str) -> str:
        if m := re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", name):
            return f"model.layers.{m[1]}.{_inverse(self.block)[m[2]]}.{m[3]}"
        module, _, kind = name.rpartition(".")
        return f"{_inverse(self.outside)[module]}.{kind}"


def _inverse(names: dict[str, str]) -> dict[str, str]:
    return {ours: theirs for theirs, ours in names.items()}


class Family:
    """One family's spec. A block's linear layers are named alike in every method (`attn.q`, `mlp.down`...): the
    names of the torch module's parameters under `blocks.N.`."""

    name: ClassVar[str]
    model: ClassVar[str]  # the torch module, as "package.module:Class": imported when built
    keys: ClassVar[tuple[str, ...]] = ()  # the model-section keys this family reads beyond the shared shape
    tp_plan: ClassVar[dict[str, str]]  # each block's linear layers: split by output column (col) or input row (row)
    lora_targets: ClassVar[tuple[str, ...]]  # finetune.lora.targets when a config leaves them out
    residual: ClassVar[tuple[str, ...]]  # weights writing into the residual stream: GPT-2's scaled initialisation
    presets: ClassVar[tuple[str, ...]] = ()  # etrain/configs/<name>.yaml of this family
    hf: ClassVar[HFFormat | None] = None

    def check(self, cfg: ModelConfig) -> None:
        """ValueError for a shape this family cannot build, naming the keys."""

    def ffn_width(self, cfg: ModelConfig) -> int:
        raise NotImplementedError

    def block_linears(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """A block's linear layers by name, each (in, out) features."""
        raise NotImplementedError

    def block_params(self, cfg: ModelConfig, tp: int = 1) -> int:
        """One block's parameters, of one of `tp` tensor-parallel ranks: its linear layers split, its norms whole."""
        raise NotImplementedError

    def norm_params(self, cfg: ModelConfig) -> int:
        """The final norm's parameters."""
        raise NotImplementedError

    def flops_per_token(self, cfg: ModelConfig, params: int, trainable: int) -> float:
        """Training FLOPs per token: 6 per parameter plus attention (PaLM appendix B, as nanoGPT counts). A frozen
        parameter (a LoRA run's base) costs 4: the forward and the gradient through it, no gradient of its own."""
        return 4 * params + 2 * trainable + 12 * cfg.n_layer * cfg.n_head * cfg.head_width * cfg.seq_len

    def build(self, cfg: ModelConfig) -> nn.Module:
        module, _, name = self.model.partition(":")
        return getattr(import_module(module), name)(cfg)
