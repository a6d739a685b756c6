"""GPT-2's decoder: pre-norm blocks of LayerNorm, attention and a GELU MLP, rotary or learned positions, dropout, a
tied or untied head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from etrain.core.config import ModelConfig
from etrain.core.models.shared import KVCache, LanguageModel, Rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim, self.dropout = cfg.d_model // cfg.n_head, cfg.dropout
        # q, k and v apart: split by output column (tensor parallelism), each rank keeps whole heads of all three
        self.q, self.k, self.v = (nn.Linear(cfg.d_model, cfg.d_model, bias=False) for _ in range(3))
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rotary = Rotary(cfg, "neighbours") if cfg.positions == "rotary" else None
        self._register_load_state_dict_pre_hook(_split_fused_qkv)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape  # the heads a rank holds follow from the width it is given: n_head / tp under TP
        q, k, v = (z(x).view(b, t, -1, self.head_dim).transpose(1, 2) for z in (self.q, self.k, self.v))
        start = cache.length if cache is not None else 0
        if self.rotary is not None:
            q, k = self.rotary(q, start), self.rotary(k, start)
        if cache is not None:
            k, v = cache.extend(k, v)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0, dropout_p=drop)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def _split_fused_qkv(state_dict: dict, prefix: str, *args) -> None:
    """Checkpoints written before q, k and v were apart hold one fused `qkv` weight: its rows are q | k | v."""
    fused = state_dict.pop(prefix + "qkv.weight", None)
    if fused is not None:
        for name, part in zip("qkv", fused.chunk(3)):
            state_dict[prefix + name + ".weight"] = part


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cache)
        return x + self.mlp(self.norm2(x))


class GPT(LanguageModel):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.positions == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        # by index, so that a pipeline stage keeping some blocks (etrain/core/parallel.py) keeps their names
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._initialise()

    def trunk(self, x: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        if self.embed is not None:
            idx, x = x, self.embed(x)
            if self.pos is not None:
                start = caches[0].length if caches else 0
                x = x + self.pos(torch.arange(start, start + idx.shape[1], device=idx.device))
            x = self.drop(x)
        for i, block in enumerate(self.blocks.values()):
            x = block(x, caches[i] if caches else None)
        return x
