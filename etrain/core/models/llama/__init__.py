"""The Llama family (model.family=llama: Llama 2 and 3, Mistral, Qwen2): RMSNorm, rotary positions (with Llama
3.1's frequency scaling), a SwiGLU MLP, grouped-query attention, optional q/k/v biases, a tied or untied head; read
from and written to Hugging Face directories (hf.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from etrain.core.models.family import Family
from etrain.core.models.llama.hf import LlamaFormat

if TYPE_CHECKING:
    from etrain.core.config import ModelConfig


class LlamaFamily(Family):
    name = "llama"
    model = "etrain.core.models.llama.model:Llama"
    keys = (
        "n_kv_head",
        "ffn_dim",
        "head_dim",
        "rope_theta",
        "rope_scaling",
        "norm_eps",
        "qkv_bias",
        "o_bias",
        "mlp_bias",
    )
    tp_plan = {
        **{"attn.q": "col", "attn.k": "col", "attn.v": "col", "attn.o": "row"},
        **{"mlp.gate": "col", "mlp.up": "col", "mlp.down": "row"},
    }
    lora_targets = ("attn.q", "attn.k", "attn.v", "attn.o")
    residual = ("attn.o.weight", "mlp.down.weight")
    presets = ("llama-tiny", "llama3-8b")
    hf = LlamaFormat()

    def check(self, cfg: ModelConfig) -> None:
        if cfg.positions != "rotary" or cfg.dropout:
            raise ValueError(
                "model.family=llama has rotary positions and no dropout: leave out model.positions and model.dropout"
            )
        if cfg.n_head % cfg.kv_heads:
            raise ValueError(f"model.n_kv_head={cfg.kv_heads} must divide model.n_head={cfg.n_head}")
        if cfg.head_dim is None and cfg.d_model % cfg.n_head:
            raise ValueError(
                f"model.d_model={cfg.d_model} must be a multiple of model.n_head={cfg.n_head}, or set model.head_dim"
            )

    def ffn_width(self, cfg: ModelConfig) -> int:
        """The given width, or 8/3·d_model rounded up to a multiple of 64."""
        return cfg.ffn_dim or -(-8 * cfg.d_model // 3 // 64) * 64

    def block_linears(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        d, f = cfg.d_model, self.ffn_width(cfg)
        q, kv = cfg.n_head * cfg.head_width, cfg.kv_heads * cfg.head_width
        return {"attn.q": (d, q), "attn.k": (d, kv), "attn.v": (d, kv), "attn.o": (q, d)} | {
            "mlp.gate": (d, f),
            "mlp.up": (d, f),
            "mlp.down": (f, d),
        }

    def block_params(self, cfg: ModelConfig, tp: int = 1) -> int:
        d, f = cfg.d_model, self.ffn_width(cfg)
        q, kv = cfg.n_head * cfg.head_width, cfg.kv_heads * cfg.head_width
        attention = d * (q + 2 * kv) + q * d + (q + 2 * kv) * cfg.qkv_bias
        mlp = 3 * d * f + 2 * f * cfg.mlp_bias
        return (attention + mlp) // tp + d * (cfg.o_bias + cfg.mlp_bias) + 2 * d

    def norm_params(self, cfg: ModelConfig) -> int:
        return cfg.d_model


FAMILY = LlamaFamily()
