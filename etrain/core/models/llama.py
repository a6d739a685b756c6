"""The Llama family (Llama 2 and 3, Mistral, Qwen2): RMSNorm, rotary positions (with Llama 3.1's frequency
scaling), a SwiGLU MLP, grouped-query attention, optional q/k/v biases, a tied or untied head.

Rotary positions rotate the two halves of each head (Hugging Face's layout), not interleaved pairs (Meta's original
checkpoints, torchtitan's): the weights of a Hugging Face directory load as they are, with no q/k permutation, and
tests/test_llama.py holds the logits to `transformers`' own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from etrain.core.config import ModelConfig
from etrain.core.model import KVCache, LanguageModel


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Each rotary pair's frequency; with `rope_scaling`, Llama 3.1's: low frequencies (wavelengths beyond the
    original context) divided by `factor`, high ones kept, the band between blended smoothly."""
    d = cfg.head_width
    inv = 1.0 / (cfg.rope_theta or 10_000.0) ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    if cfg.rope_scaling is None:
        return inv
    r = cfg.rope_scaling
    factor, low, high, context = r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings
    wavelength = 2 * math.pi / inv
    scaled = torch.where(wavelength > context / low, inv / factor, inv)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, blended, scaled)


class Rotary(nn.Module):
    """cos and sin tables over the head's two halves; buffers, rebuilt rather than checkpointed."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("cos", torch.empty(cfg.seq_len, cfg.head_width), persistent=False)
        self.register_buffer("sin", torch.empty(cfg.seq_len, cfg.head_width), persistent=False)
        self.reset()

    def reset(self) -> None:
        """The tables, on the device the buffers are on (a model built on the meta device fills them here)."""
        if self.cos.is_meta:
            return
        inv = inverse_frequencies(self.cfg).to(self.cos.device)
        angles = torch.outer(torch.arange(self.cfg.seq_len, device=inv.device).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:  # x: (B, H, T, D)
        t, half = x.shape[-2], x.shape[-1] // 2
        cos, sin = self.cos[start : start + t].to(x.dtype), self.sin[start : start + t].to(x.dtype)
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


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
        self.rotary = Rotary(cfg)

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
