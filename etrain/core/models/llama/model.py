"""The Llama family's decoder (its spec: __init__.py): RMSNorm, rotary positions over each head's two halves
(Hugging Face's layout: a Hugging Face directory's weights load as they are, with no q/k permutation, and
tests/test_llama.py holds the logits to `transformers`' own), a SwiGLU MLP, grouped-query attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from etrain.core.config import ModelConfig
from etrain.core.models.shared import KVCache, LanguageModel, Rotary


class RMSNorm(nn.Module):
    """Normalised in fp32 whatever the input's precision, scaled in it (as the reference implementation does)."""

    def __init__(self, width: int, eps: float | None):
        super().__init__()
        self.eps = eps or 1e-5
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.d_model, cfg.head_width
        self.head_dim = hd
        self.q = nn.Linear(d, cfg.n_head * hd, bias=cfg.qkv_bias)
        self.k = nn.Linear(d, cfg.kv_heads * hd, bias=cfg.qkv_bias)
        self.v = nn.Linear(d, cfg.kv_heads * hd, bias=cfg.qkv_bias)
        self.o = nn.Linear(cfg.n_head * hd, d, bias=cfg.o_bias)
        self.rotary = Rotary(cfg, "halves")

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape  # the heads come from the widths held: n_head / tp and n_kv_head / tp under TP
        q, k, v = (z(x).view(b, t, -1, self.head_dim).transpose(1, 2) for z in (self.q, self.k, self.v))
        start = cache.length if cache is not None else 0
        q, k = self.rotary(q, start), self.rotary(k, start)
        if cache is not None:
            k, v = cache.extend(k, v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0, enable_gqa=q.shape[1] != k.shape[1])
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_width, bias=cfg.mlp_bias)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_width, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.ffn_width, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps), RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn, self.mlp = Attention(cfg), MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache)
        return x + self.mlp(self.mlp_norm(x))


class Llama(LanguageModel):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = None  # rotary positions only
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._initialise()

    def trunk(self, x: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for i, block in enumerate(self.blocks.values()):
            x = block(x, caches[i] if caches else None)
        return x
