"""The model's section: its family and shape, and what follows from them by arithmetic (parameter counts, the
linear layers LoRA can target)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from etrain.core.config.base import Section


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
