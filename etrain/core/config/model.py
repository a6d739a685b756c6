"""The model's section: its family and shape, and what follows from them by arithmetic (parameter counts, the
linear layers LoRA can target)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from etrain.core.config.base import Section
from etrain.core.models import FAMILIES, Family, family


class RopeScaling(Section):
    """Llama 3.1's rotary frequency scaling (Hugging Face's rope_type llama3)."""

    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: int = Field(8192, ge=1)


def family_keys() -> set[str]:
    """The keys some family reads beyond the shared shape (each family's spec names its own)."""
    return {key for spec in FAMILIES.values() for key in spec.keys}


class ModelConfig(Section):
    family: str = Field(
        "gpt", description=f"one of {', '.join(FAMILIES)}: its folder in etrain/core/models/ (docs/models.md)"
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
    def spec(self) -> Family:
        """The family's spec (etrain/core/models/family.py): what differs between families."""
        return family(self.family)

    @property
    def ffn_width(self) -> int:
        return self.spec.ffn_width(self)

    def param_count(self) -> int:
        """Parameters of this config's model, by arithmetic (no torch): embeddings, the blocks, the final norm, the
        head unless tied."""
        d = self.d_model
        ends = self.vocab_size * d * (1 if self.tie_weights else 2) + (
            self.seq_len * d if self.positions == "learned" else 0
        )
        return ends + self.n_layer * self.block_params() + self.spec.norm_params(self)

    def block_params(self, tp: int = 1) -> int:
        """One block's parameters, of one of `tp` tensor-parallel ranks: its linear layers split, its norms whole."""
        return self.spec.block_params(self, tp)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """The model's linear layers by name, each (in, out) features: what LoRA's targets name."""
        block = self.spec.block_linears(self)
        shapes = {f"blocks.{i}.{name}": shape for i in range(self.n_layer) for name, shape in block.items()}
        return shapes | {"head": (self.d_model, self.vocab_size)}

    @field_validator("family")
    @classmethod
    def _known_family(cls, name: str) -> str:
        family(name)  # ValueError naming the families
        return name

    @model_validator(mode="after")
    def _family_builds_it(self) -> ModelConfig:
        spec = family(self.family)
        if used := [k for k in sorted(family_keys() - set(spec.keys)) if getattr(self, k) not in (None, False)]:
            readers = sorted({f.name for f in FAMILIES.values() if set(used) & set(f.keys)})
            raise ValueError(
                f"{', '.join('model.' + k for k in used)} apply to model.family={' or '.join(readers)} only"
            )
        spec.check(self)
        if self.positions == "rotary" and self.head_width % 2:
            raise ValueError("rotary positions need an even head width (d_model / n_head, or model.head_dim)")
        return self
