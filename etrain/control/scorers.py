"""What a PPO step asks of others: the frozen reference model's log-probabilities (the KL penalty is measured
against it) and the reward's scores. Each is one Ray actor per job, on CPU, started by the coordinator with no CPU
of its own reserved: they run while the workers wait on them, one call at a time. Neither holds state, so Ray
restarts one that dies and retries the call."""

from __future__ import annotations

import ray
import torch

from etrain.core.config import Config
from etrain.core.finetune import load_base
from etrain.core.models import make_model
from etrain.core.ppo import token_logprobs
from etrain.data.rewards import load, score_all


class Reference:
    """The base model the run started from, as it was: LoRA or full, the policy moves away from it."""

    def __init__(self, cfg_dict: dict):
        cfg = Config.model_validate(cfg_dict)
        torch.set_num_threads(1)
        self.model = make_model(cfg.model).eval()
        load_base(self.model, cfg.finetune)

    @torch.no_grad()
    def logprobs(self, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """(B, T): log pi_ref of each response token of `sequences` (B, prompt_len + T)."""
        logits = self.model.logits(sequences)[:, prompt_len - 1 : -1]
        return token_logprobs(logits, sequences[:, prompt_len:])


class Rewarder:
    def __init__(self, spec: str, prompts: str | None):
        self.task = load(spec, prompts)

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return score_all(self.task, prompts, responses)


def start(cfg: Config) -> tuple:
    """(reference, rewarder) for a PPO run, both started: ppo.reward_timeout_s is the reward's time to score, so
    the rewarder's own start (a process, torch, the user's module) must not count against the first call."""
    again = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": -1}
    reference = ray.remote(Reference).options(**again).remote(cfg.model_dump())
    rewarder = ray.remote(Rewarder).options(**again).remote(cfg.ppo.reward, cfg.ppo.prompts)
    try:
        ray.get([reference.__ray_ready__.remote(), rewarder.__ray_ready__.remote()], timeout=cfg.timeouts.join_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"the PPO reference model and reward {cfg.ppo.reward} did not start within timeouts.join_s="
            f"{cfg.timeouts.join_s:g}: is the cluster short of memory or processes?"
        ) from None
    return reference, rewarder
