"""What a PPO step asks of others: the frozen reference model's log-probabilities (the KL penalty is measured
against it) and the reward's scores. Each is one Ray actor per job, on CPU, started by the coordinator with no CPU
of its own reserved: they run while the workers wait on them, one call at a time. Neither holds state, so Ray
restarts one that dies and retries the call."""

from __future__ import annotations

import ray
import torch

from app.core.config import Config
from app.core.finetune import load_base
from app.core.model import GPT
from app.core.ppo import token_logprobs
from app.core.rewards import RewardError, load, score_all


class Reference:
    """The base model the run started from, as it was: LoRA or full, the policy moves away from it."""

    def __init__(self, cfg_dict: dict):
        cfg = Config.model_validate(cfg_dict)
        torch.set_num_threads(1)
        self.model = GPT(cfg.model).eval()
        load_base(self.model, cfg.finetune)

    @torch.no_grad()
    def logprobs(self, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """(B, T): log pi_ref of each response token of `sequences` (B, prompt_len + T)."""
        logits = self.model.logits(sequences)[:, prompt_len - 1 : -1]
        return token_logprobs(logits, sequences[:, prompt_len:])


class Rewarder:
    def __init__(self, spec: str):
        self.task = load(spec)

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return score_all(self.task, prompts, responses)


def wait_for_scores(rewarder, prompts: list[str], responses: list[str], cfg: Config, ask=None) -> list[float]:
    """The reward's scores of a worker's responses, within ppo.reward_timeout_s (one rewarder serves every worker,
    one call at a time, so the wait includes the calls queued before this one). A slow or failing reward is named
    (RewardError), never taken for a hung worker. `ask`: the call, made already."""
    ref = ask if ask is not None else rewarder.score.remote(prompts, responses)
    limit = cfg.reward_timeout_s()
    try:
        return ray.get(ref, timeout=limit)
    except ray.exceptions.GetTimeoutError:
        raise RewardError(
            f"reward {cfg.ppo.reward} did not score {len(responses)} responses within ppo.reward_timeout_s={limit:g} "
            "(one call at a time serves every worker: the calls before this one count); make it faster, or raise "
            "ppo.reward_timeout_s (below timeouts.step_s)"
        ) from None
    except ray.exceptions.RayTaskError as e:
        raise e.cause from None  # the reward's own error (RewardError), not Ray's wrapper


def start(cfg: Config) -> tuple:
    """(reference, rewarder) for a PPO run."""
    again = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": -1}
    reference = ray.remote(Reference).options(**again).remote(cfg.model_dump())
    rewarder = ray.remote(Rewarder).options(**again).remote(cfg.ppo.reward)
    return reference, rewarder
