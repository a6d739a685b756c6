"""GPT-style decoder-only transformer (pre-norm, rotary or learned positions, tied head)."""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from etrain.core.config import ModelConfig


class Rotary(nn.Module):
    """Rotary position embedding; tables are buffers, rebuilt rather than checkpointed."""

    def __init__(self, head_dim: int, seq_len: int, base: float = 10_000.0):
        super().__init__()
        self.head_dim, self.seq_len, self.base = head_dim, seq_len, base
        self.register_buffer("cos", torch.empty(seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(seq_len, head_dim // 2), persistent=False)
        self.reset()

    def reset(self) -> None:
        """The tables, on the device the buffers are on (a model built on the meta device fills them here)."""
        if self.cos.is_meta:
            return
        device = self.cos.device
        inv_freq = 1.0 / self.base ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim)
        angles = torch.outer(torch.arange(self.seq_len, device=device).float(), inv_freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:  # x: (B, H, T, D) at positions start...
        t = x.shape[-2]
        cos, sin = self.cos[start : start + t].to(x.dtype), self.sin[start : start + t].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim, self.dropout = cfg.d_model // cfg.n_head, cfg.dropout
        # q, k and v apart: split by output column (tensor parallelism), each rank keeps whole heads of all three
        self.q, self.k, self.v = (nn.Linear(cfg.d_model, cfg.d_model, bias=False) for _ in range(3))
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rotary = Rotary(self.head_dim, cfg.seq_len) if cfg.positions == "rotary" else None
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


class KVCache:
    """One attention layer's keys and values of the tokens so far, for sampling (driver/generate.py): the prompt goes
    through once, causally, then one token per step, which attends to every cached one."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat((self.k, k), dim=-2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=-2)
        return self.k, self.v


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


class LanguageModel(nn.Module):
    """What every family shares (etrain/core/models/ holds the others): the modules embed, blocks by index, norm and
    head, which a pipeline stage drops where it does not compute them (etrain/core/parallel.py); the forward every
    engine calls; PPO's value head; a model built on the meta device given storage. A family defines its modules
    and `trunk`."""

    cfg: ModelConfig
    value_head: nn.Linear | None

    def _initialise(self) -> None:
        """Every weight initial_weight's, unless built on the meta device (then `materialize` and a load)."""
        if self.cfg.tie_weights:
            self.head.weight = self.embed.weight
        self.value_head = None  # PPO's critic (add_value_head)
        if not self.head.weight.is_meta:
            with torch.no_grad():
                for name, p in self.named_parameters():
                    p.copy_(initial_weight(self.cfg, name, p.shape, torch.initial_seed()))

    def materialize(self, device: torch.device) -> LanguageModel:
        """A model built on the meta device (or its part: etrain/core/parallel.py), given storage on `device`; its
        buffers filled, its weights not (layout_state.load_full takes them from InitialWeights or a checkpoint)."""
        self.to_empty(device=device)
        if self.cfg.tie_weights and self.embed is not None and self.head is not None:
            self.head.weight = self.embed.weight  # to_empty gives each module its own tensor: tied again
        for module in self.modules():
            if hasattr(module, "reset"):  # tables computed, not trained: rotary positions
                module.reset()
        return self

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, values: bool = False):
        """(logits, loss), or with `values` (logits, the value head's estimate at each position): through one
        forward, as DDP needs every trained parameter to be used by it."""
        if values:
            hidden = self.norm(self.trunk(idx))
            return self.head(hidden), self.value_head(hidden).squeeze(-1)
        logits = self.logits(idx)
        return logits, None if targets is None else next_token_loss(logits, targets)

    def add_value_head(self) -> None:
        """A critic beside the language-model head, started at zero: its first estimates are 0."""
        self.value_head = nn.Linear(self.cfg.d_model, 1).to(self.head.weight.device)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def logits(self, x: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        """Through the parts this model holds: a pipeline stage (etrain/core/parallel.py) takes token ids or hidden
        states and gives hidden states or logits. With `caches` (one per block), the tokens after those cached."""
        x = self.trunk(x, caches)
        return x if self.head is None else self.head(self.norm(x))

    def trunk(self, x: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        """Embedding (on the first stage) and the blocks: the hidden states before the final norm."""
        raise NotImplementedError

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


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


def make_model(cfg: ModelConfig) -> LanguageModel:
    """The model of `cfg`'s family, its weights initial_weight's (none on the meta device)."""
    if cfg.family == "llama":
        from etrain.core.models.llama import Llama  # it builds on this module

        return Llama(cfg)
    return GPT(cfg)


def initial_weight(cfg: ModelConfig, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The initial value of the weight `name`, a function of the seed and the name alone: a rank that holds a part of
    the model makes any tensor's value without the others' (one tensor at a time, on CPU). Linear and embedding
    weights N(0, 0.02), with GPT-2's scaled init of residual projections, which keeps the residual stream's variance
    flat in depth; norms 1 and 0."""
    module = name.rpartition(".")[0]
    if module.endswith("norm") or module.endswith(("norm1", "norm2")):
        return torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    residual = ("attn.proj.weight", "mlp.2.weight", "attn.o.weight", "mlp.down.weight")  # GPT's, Llama's
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(residual) else 0.02
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.normal(0.0, std, tuple(shape), generator=generator)


class InitialWeights(dict):
    """The initial weights by name, each made when asked for (initial_weight): what a part of a model built on the
    meta device takes its values from (layout_state.load_full), never the whole model at once."""

    def __init__(self, cfg: ModelConfig, seed: int):
        super().__init__()
        self.cfg, self.seed = cfg, seed
        with torch.device("meta"):
            self.shapes = {n: p.shape for n, p in make_model(cfg).named_parameters(remove_duplicate=False)}

    def __missing__(self, name: str) -> torch.Tensor:
        tied = name == "head.weight" and self.cfg.tie_weights
        return initial_weight(self.cfg, "embed.weight" if tied else name, self.shapes[name], self.seed)


@torch.no_grad()
def sample(
    model: GPT, prompts: torch.Tensor, steps: int, temperature: float, generator: torch.Generator
) -> torch.Tensor:
    """`prompts` (B, P) each continued by `steps` tokens drawn from the model at `temperature`. No cache: the
    sequence goes through the model whole at each step, which the short responses PPO samples can afford."""
    x = prompts
    for _ in range(steps):
        logits = model.logits(x[:, -model.cfg.seq_len :])[:, -1].float() / temperature
        x = torch.cat([x, torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)], 1)
    return x


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position, in fp32 whatever the logits' precision."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
