"""A rank's memory, by arithmetic on the config (no torch): what `etrain config` prints, and what a job checks
against the machines before it starts.

The fullest rank is the first pipeline stage's, which holds the embedding. Its parts:

- weights, gradients and optimizer: fp32, AdamW's two moments (16 bytes per parameter; with LoRA, 4 per frozen
  weight and 16 per adapter parameter); a block's tensors split over parallel.tp, the blocks over parallel.pp's
  stages, everything over parallel.shard (FSDP2), AdamW's state over the workers with ZeRO-1; DiLoCo adds the outer
  parameters and momentum (8 bytes per trained parameter) to the optimizer's part.
- activations: one micro-batch's kept for backward (Korthikanti et al. 2022, per layer 10·s·b·h + 24·s·b·h/t +
  5·a·s²·b/t bytes at 16 bits, twice that in fp32; the s² term is an upper bound: fused attention keeps no scores),
  and the logits and their gradient.
- gathered: the whole parameters of the block FSDP computes and of the next it prefetches, in the precision they
  compute in.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from etrain.core.config.finetune import targeted

if TYPE_CHECKING:
    from etrain.core.config.root import Config


def lora_params(cfg: Config) -> int:
    """Parameters of the LoRA adapters `cfg` puts on the model (0 without LoRA)."""
    if not cfg.finetune.lora_on:
        return 0
    lora = cfg.finetune.lora
    return sum(lora.rank * (i + o) for n, (i, o) in cfg.model.linear_shapes().items() if targeted(n, lora.targets))


def worker_memory(cfg: Config) -> int:
    """About the bytes one worker (one rank) needs: the sum of rank_memory."""
    return sum(rank_memory(cfg).values())


def rank_memory(cfg: Config) -> dict[str, int]:
    """About the bytes the fullest rank holds, by part (the module's docstring says how each is counted)."""
    weights, gradients, optimizer = _state_bytes(cfg, _rank_params(cfg))
    return {
        "weights": weights,
        "gradients": gradients,
        "optimizer": optimizer,
        "activations": _activation_bytes(cfg),
        "gathered": _gathered_bytes(cfg),
    }


def _stage_layers(cfg: Config) -> int:
    """Blocks on the fullest pipeline stage."""
    return math.ceil(cfg.model.n_layer / cfg.parallel.pp)


def _rank_params(cfg: Config) -> int:
    """The fullest rank's parameters: the ends (embeddings, final norm, head) whole, its stage's blocks split over
    parallel.tp."""
    m = cfg.model
    return (m.param_count() - m.n_layer * m.block_params()) + _stage_layers(cfg) * m.block_params(cfg.parallel.tp)


def _state_bytes(cfg: Config, params: int) -> tuple[int, int, int]:
    """Weights, gradients and optimizer state of a rank holding `params` parameters."""
    if cfg.finetune.lora_on:
        trained = lora_params(cfg)
        weights, gradients, optimizer = 4 * (params + trained), 4 * trained, 8 * trained
    else:
        weights, gradients, optimizer = 4 * params, 4 * params, 8 * params
    weights, gradients, optimizer = (x // cfg.parallel.shard for x in (weights, gradients, optimizer))
    if cfg.comm.zero:
        optimizer //= max(cfg.cluster.num_workers, 1)
    if cfg.comm.mode == "diloco":  # the outer parameters and their momentum, beside the inner optimizer's
        optimizer += 8 * (lora_params(cfg) if cfg.finetune.lora_on else params)
    return weights, gradients, optimizer


def _activation_bytes(cfg: Config) -> int:
    """One micro-batch's activations kept for backward on the fullest stage, and the logits with their gradient."""
    m, tp, b = cfg.model, cfg.parallel.tp, cfg.train.micro_batch
    width = 2 if cfg.train.precision == "fp32" else 1
    d, s = m.d_model, m.seq_len
    per_layer = (10 * s * b * d + 24 * s * b * d // tp + 5 * m.n_head * s * s * b // tp) * width
    return _stage_layers(cfg) * per_layer + 8 * b * s * m.vocab_size


def _gathered_bytes(cfg: Config) -> int:
    """Two whole blocks FSDP holds gathered (the one computing, the one prefetched); none without sharding."""
    if cfg.parallel.shard == 1:
        return 0
    return 2 * cfg.model.block_params(cfg.parallel.tp) * (2 if cfg.train.precision == "bf16" else 4)
