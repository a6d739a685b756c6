"""What a worker and the coordinator's side hand each other, and the only module of `actors` both sides import
(tests/test_layers.py): a worker's report of its part of a step, and a PPO worker's bounded wait for the reward's
answer (the reward is an actor the coordinator starts: etrain/control/scorers.py)."""

from __future__ import annotations

from dataclasses import dataclass

import ray

from etrain.core.config import Config
from etrain.core.rewards import RewardError


@dataclass
class StepReport:
    """One worker's part of a step (etrain/worker/actor.py `train_step`, `ppo_step`)."""

    finite: bool  # every rank holds the same synchronised gradient, so every rank says the same
    skipped: bool  # above the outlier guard's limit: the update was skipped
    loss: float  # this worker's share of the step's mean loss
    grad_norm: float
    lr: float
    share: int  # samples of the step's batch this worker took
    compute_s: float  # forward and backward up to the last gradient bucket: no waiting on peers
    communication_s: float  # the all-reduce time not hidden behind the backward pass
    worker_s: float
    comm_bytes: int
    dense_bytes: int
    optimizer_bytes: int  # this rank's optimizer state
    param_bytes: int  # this rank's parameters: its shards of a sharded model's
    peak_rss: int  # the worker process's peak resident memory so far, in bytes
    data: dict  # hits, misses, wait_s
    saving: bool  # a checkpoint part is still being written
    update_s: float = 0.0  # clipping and the optimizer's step
    ppo: dict | None = None  # a PPO step's sums over this worker's rollouts (etrain/worker/rollout.py)


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
