"""PPO's objective for a language model, as "The N Implementation Details of RLHF with PPO" and OpenRLHF have it.

A rollout is a batch of responses (B, T) with a mask over their tokens. Each token's reward is the KL penalty
-beta * (log pi - log pi_ref); the task's score is added at the last token. Advantages come from GAE (gamma 1,
lambda 0.95 by default) over the value head's estimates, and are whitened over the whole rollout: every worker's
tokens, so `moments` gives sums the caller all-reduces. The policy loss is PPO's clipped surrogate and the value
loss is clipped around the rollout's values. The KL coefficient adapts towards a target KL (Ziegler et al. 2019).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log pi(token) under `logits` (B, T, V), in fp32."""
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_rewards(
    score: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """(B, T): -beta * (log pi - log pi_ref) at every response token, plus each response's score at its last."""
    rewards = -beta * (logprobs - ref_logprobs) * mask
    last = mask.sum(1).long() - 1  # responses are left-aligned: token t of a response sits at column t
    rewards[torch.arange(len(score)), last.clamp(min=0)] += score * (last >= 0)
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each (B, T): GAE over each response, nothing bootstrapped past its last token."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros_like(running)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * m
        advantages[:, t] = running
        next_value = values[:, t] * m
    return advantages, (advantages + values) * mask


def moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares, count] of the masked entries: add them over workers, then `whiten`."""
    x = x * mask
    return torch.stack([x.sum(), (x * x).sum(), mask.sum()]).double()


def whiten(x: torch.Tensor, sums: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """x minus the mean, over the standard deviation, of the masked entries that `sums` (from `moments`) describe."""
    total, squares, count = sums.tolist()
    mean = total / count
    var = max(squares / count - mean * mean, 0.0) * count / max(count - 1, 1)  # unbiased, as torch.var
    return (x - mean) / (var**0.5 + eps) * mask


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, clip fraction): PPO's clipped surrogate, and the share of tokens whose ratio the clip bound."""
    ratio = (logprobs - old_logprobs).exp()
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).float(), mask).detach()


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> torch.Tensor:
    """Half the squared error to the returns, the larger of the unclipped and the one clipped around the rollout's."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask)


def entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean entropy of the policy's next-token distributions over the response tokens."""
    logp = torch.log_softmax(logits.float(), -1)
    return masked_mean(-(logp.exp() * logp).sum(-1), mask)


@dataclass
class AdaptiveKL:
    """beta follows the measured KL towards `target`: proportional, error clipped to ±0.2, over `horizon` samples
    (Ziegler et al.). Slow by design, it trims beta over thousands of responses; `boosted` meets an overshoot now."""

    beta: float
    target: float
    horizon: int

    def update(self, kl: float, samples: int) -> float:
        error = min(max(kl / self.target - 1, -0.2), 0.2)
        self.beta *= 1 + error * samples / self.horizon
        return self.beta


def boosted(beta: float, kl: float, target: float, gain: float) -> float:
    """The coefficient a step applies: beta, times (kl / target)^gain when the step's own rollouts are above the
    target. An overshoot is penalised in the step that shows it (the penalty grows as its power), and the boost is
    gone once the KL is back: no wind-up, which would hold the policy at the reference long after."""
    return beta * max(1.0, kl / target) ** gain
