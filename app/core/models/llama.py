"""The Llama family (Llama 2 and 3, Mistral, Qwen2): RMSNorm, rotary positions (with Llama 3.1's frequency
scaling), a SwiGLU MLP, grouped-query attention, optional q/k/v biases, a tied or untied head.

Rotary positions rotate the two halves of each head (Hugging Face's layout), not interleaved pairs (Meta's original
checkpoints, torchtitan's): the weights of a Hugging Face directory load as they are, with no q/k permutation, and
tests/test_llama.py holds the logits to `transformers`' own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from app.core.model import next_token_loss


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int  # grouped-query attention: n_head / n_kv_head query heads share each key/value head
    ffn_dim: int  # the SwiGLU MLP's hidden width
    seq_len: int  # the longest sequence the rotary tables cover
    head_dim: int | None = None  # d_model / n_head unless given
    rope_theta: float = 10_000.0
    rope_scaling: tuple[float, float, float, int] | None = None  # llama3: factor, low and high freq factors, context
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False
    mlp_bias: bool = False
    tie_weights: bool = False

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.n_head


def inverse_frequencies(args: LlamaArgs) -> torch.Tensor:
    """Each rotary pair's frequency; with `rope_scaling`, Llama 3.1's: low frequencies (wavelengths beyond the
    original context) divided by `factor`, high ones kept, the band between blended smoothly."""
    d = args.head_width
    inv = 1.0 / args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    if args.rope_scaling is None:
        return inv
    factor, low, high, context = args.rope_scaling
    wavelength = 2 * math.pi / inv
    scaled = torch.where(wavelength > context / low, inv / factor, inv)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, blended, scaled)


class Rotary(nn.Module):
    """cos and sin tables over the head's two halves; buffers, rebuilt rather than checkpointed."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.register_buffer("cos", torch.empty(args.seq_len, args.head_width), persistent=False)
        self.register_buffer("sin", torch.empty(args.seq_len, args.head_width), persistent=False)
        self.reset()

    def reset(self) -> None:
        if self.cos.is_meta:
            return
        inv = inverse_frequencies(self.args).to(self.cos.device)
        angles = torch.outer(torch.arange(self.args.seq_len, device=inv.device).float(), inv)
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

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        d, hd = args.d_model, args.head_width
        self.head_dim = hd
        self.q = nn.Linear(d, args.n_head * hd, bias=args.qkv_bias)
        self.k = nn.Linear(d, args.n_kv_head * hd, bias=args.qkv_bias)
        self.v = nn.Linear(d, args.n_kv_head * hd, bias=args.qkv_bias)
        self.o = nn.Linear(args.n_head * hd, d, bias=args.o_bias)
        self.rotary = Rotary(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # the heads come from the widths held: n_head / tp and n_kv_head / tp under TP
        q, k, v = (z(x).view(b, t, -1, self.head_dim).transpose(1, 2) for z in (self.q, self.k, self.v))
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.gate = nn.Linear(args.d_model, args.ffn_dim, bias=args.mlp_bias)
        self.up = nn.Linear(args.d_model, args.ffn_dim, bias=args.mlp_bias)
        self.down = nn.Linear(args.ffn_dim, args.d_model, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(args.d_model, args.norm_eps), RMSNorm(args.d_model, args.norm_eps)
        self.attn, self.mlp = Attention(args), MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """The interface of app.core.model.GPT: forward(idx, targets) -> (logits, loss), logits, trunk."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layer)})  # by index, as GPT's
        self.norm = RMSNorm(args.d_model, args.norm_eps)
        self.head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        if args.tie_weights:
            self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.logits(idx)
        return logits, None if targets is None else next_token_loss(logits, targets)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.trunk(idx)))

    def trunk(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks.values():
            x = block(x)
        return x
