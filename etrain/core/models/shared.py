"""What every model family shares: the LanguageModel every engine drives (its parts by name, the forward, PPO's
value head, a model built on the meta device), rotary positions, the KV cache of sampling, the initial weights (a
function of the seed and the name alone) and the loss."""

from __future__ import annotations

import math
import zlib
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from etrain.core.config import ModelConfig
from etrain.core.models import family, make_model


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
    """Rotary position embedding; its tables are buffers, rebuilt rather than checkpointed. A head's dimensions
    rotate in pairs: GPT's are neighbours (0 with 1, 2 with 3: Meta's original layout), Llama's the two halves (0
    with D/2: Hugging Face's, so that its checkpoints load with no permutation of q and k)."""

    def __init__(self, cfg: ModelConfig, pairs: Literal["neighbours", "halves"]):
        super().__init__()
        self.cfg, self.pairs = cfg, pairs
        self.register_buffer("cos", torch.empty(cfg.seq_len, cfg.head_width // 2), persistent=False)
        self.register_buffer("sin", torch.empty(cfg.seq_len, cfg.head_width // 2), persistent=False)
        self.reset()

    def reset(self) -> None:
        """The tables, on the device the buffers are on (a model built on the meta device fills them here)."""
        if self.cos.is_meta:
            return
        inv = inverse_frequencies(self.cfg).to(self.cos.device)
        angles = torch.outer(torch.arange(self.cfg.seq_len, device=inv.device).float(), inv)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:  # x: (B, H, T, D) at positions start...
        t = x.shape[-2]
        cos, sin = self.cos[start : start + t].to(x.dtype), self.sin[start : start + t].to(x.dtype)
        if self.pairs == "neighbours":
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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


class LanguageModel(nn.Module):
    """What every family's model is: the modules embed, blocks by index, norm and head, which a pipeline stage drops
    where it does not compute them (etrain/core/parallel.py); the forward every engine calls; PPO's value head; a
    model built on the meta device given storage. A family defines its modules and `trunk`."""

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


def initial_weight(cfg: ModelConfig, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The initial value of the weight `name`, a function of the seed and the name alone: a rank that holds a part of
    the model makes any tensor's value without the others' (one tensor at a time, on CPU). Linear and embedding
    weights N(0, 0.02), with GPT-2's scaled init of residual projections, which keeps the residual stream's variance
    flat in depth; norms 1 and 0."""
    module = name.rpartition(".")[0]
    if "norm" in module.rpartition(".")[2]:
        return torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(family(cfg.family).residual) else 0.02
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
    model: LanguageModel, prompts: torch.Tensor, steps: int, temperature: float, generator: torch.Generator
) -> torch.Tensor:
    """`prompts` (B, P) each continued by `steps` tokens drawn from the model at `temperature`. No cache: the
    sequence goes through the model whole at each step, which the short responses PPO samples can afford."""
    x = prompts
    for _ in range(steps):
        logits = model.logits(x[:, -model.cfg.seq_len :])[:, -1].float() / temperature
        x = torch.cat([x, torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)], 1)
    return x


IGNORED = -100  # a target the loss skips (F.cross_entropy's ignore_index)


def inputs_and_targets(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of seq_len + 1 tokens as inputs and the shifted targets. Chat data (etrain/data/chat.py) stores a token
    the loss does not predict as `-t - 1`: its input is `t`, its target IGNORED. Pre-training rows have none."""
    x, y = rows[:, :-1], rows[:, 1:]
    return torch.where(x < 0, -x - 1, x), torch.where(y < 0, IGNORED, y)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean over rows of each row's mean cross-entropy on its targets (every position, or a chat row's answers;
    a row with none counts 0), in fp32 whatever the logits' precision. Per row, so that how rows are split across
    workers and micro-batches does not change what a step learns."""
    per_token = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORED, reduction="none"
    ).view(targets.shape)
    counted = (targets != IGNORED).sum(1).clamp(min=1)
    return (per_token.sum(1) / counted).mean()
