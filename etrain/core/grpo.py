"""GRPO's objective (Shao et al. 2024, DeepSeekMath; DeepSeek-R1): no value network. Each prompt is answered
`group` times, and a response's advantage is its score less its group's mean, over its group's standard
deviation, at every one of its tokens. The KL to the reference is in the loss, by the unbiased and always
positive estimator k3 (Schulman 2020), not in the rewards. The clipped surrogate is PPO's (etrain/core/ppo.py),
averaged over every token of the minibatch rather than per response first, so a long response counts by its
tokens (DAPO's and Dr. GRPO's correction of a length bias).

A group is one prompt's responses, consecutive in the rollout and all on one worker: the advantages need nothing
from other workers."""

from __future__ import annotations

import torch

from etrain.core.ppo import masked_mean


def group_advantages(scores: torch.Tensor, group: int, eps: float = 1e-4) -> torch.Tensor:
    """(B,): each score less its group's mean, over its group's standard deviation (unbiased, as torch.std).
    A group whose scores are all equal teaches nothing: its advantages are 0."""
    grouped = scores.view(-1, group).double()
    centred = grouped - grouped.mean(1, keepdim=True)
    return (centred / (grouped.std(1, keepdim=True) + eps)).view(-1).to(scores.dtype)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the response tokens of k3 = r - log r - 1, r = pi_ref / pi: an estimate of KL(pi || pi_ref) that
    is never negative and whose gradient pulls pi towards pi_ref."""
    log_ratio = ref_logprobs - logprobs
    return masked_mean(log_ratio.exp() - log_ratio - 1, mask)
