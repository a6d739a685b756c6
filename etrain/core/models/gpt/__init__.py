"""GPT-2's family, the trainer's first (model.family=gpt, the default): LayerNorm, a GELU MLP of 4·d_model, learned
or rotary positions, dropout. No Hugging Face format: a GPT run exports with --format run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from etrain.core.models.family import Family

if TYPE_CHECKING:
    from etrain.core.config import ModelConfig


class GPTFamily(Family):
    name = "gpt"
    model = "etrain.core.models.gpt.model:GPT"
    tp_plan = {"attn.q": "col", "attn.k": "col", "attn.v": "col", "attn.proj": "row", "mlp.0": "col", "mlp.2": "row"}
    lora_targets = ("attn.q", "attn.k", "attn.v", "attn.proj")
    residual = ("attn.proj.weight", "mlp.2.weight")
    presets = ("tiny", "small", "gpu-125m", "gpu-1b", "gpu-8b")

    def check(self, cfg: ModelConfig) -> None:
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"model.d_model={cfg.d_model} must be a multiple of model.n_head={cfg.n_head}")

    def ffn_width(self, cfg: ModelConfig) -> int:
        return 4 * cfg.d_model

    def block_linears(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        d, f = cfg.d_model, self.ffn_width(cfg)
        return {
            "attn.q": (d, d),
            "attn.k": (d, d),
            "attn.v": (d, d),
            "attn.proj": (d, d),
            "mlp.0": (d, f),
            "mlp.2": (f, d),
        }

    def block_params(self, cfg: ModelConfig, tp: int = 1) -> int:
        return 12 * cfg.d_model**2 // tp + 4 * cfg.d_model  # attention 4·d², MLP 8·d², two LayerNorms

    def norm_params(self, cfg: ModelConfig) -> int:
        return 2 * cfg.d_model


FAMILY = GPTFamily()
