"""The RL engine (Rollouts: the data-parallel engine, stepping by rollouts) and one worker's part of a PPO or GRPO
step, read top to bottom (`ppo_step`): draw the step's prompts, sample responses with the policy (ppo.group to a
prompt), have the reward score them and the reference measure them, turn the scores into advantages (PPO's: GAE
over the value head, whitened over every worker's rollouts; GRPO's: each score against its group's), then run the
updates, each through DDP.

Prompts depend on the run's seed and their index alone, and sampling on (seed, step, rank): a resumed run draws
and samples what the run that went on did.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, fields

import ray
import torch
import torch.distributed as dist

from etrain.core.config import Config
from etrain.core.grpo import group_advantages, kl_penalty
from etrain.core.models.shared import sample
from etrain.core.ppo import (
    boosted,
    entropy,
    gae,
    moments,
    policy_loss,
    token_logprobs,
    token_rewards,
    value_loss,
    whiten,
)
from etrain.data import tokenizer
from etrain.data.rewards import RewardError, Task, load
from etrain.data.tokenizer import Codec
from etrain.worker.data_parallel import DataParallel
from etrain.worker.engine import WorkerIO, peak_rss
from etrain.worker.protocol import StepReport

NO_DATA = {"hits": 0, "misses": 0, "wait_s": 0.0}  # prompts come from the task, not the shard cache


class Rollouts(DataParallel):
    """A PPO run's engine: a data-parallel worker whose step samples responses to its share of the step's prompts,
    has them scored (the reference model and the reward are actors the coordinator started: etrain/control/
    scorers.py) and runs the PPO updates on them; its held-out measure is the reward of held-out prompts. Its
    prompts and responses go through the run's tokenizer."""

    def __init__(self, cfg: Config, device: torch.device):
        super().__init__(cfg, device)
        self.task = load(cfg.ppo.reward, cfg.ppo.prompts, scoring=False)  # the prompts (scored elsewhere)
        self.codec = tokenizer.for_run(cfg)  # ... in the model's tokens

    def step(
        self, io: WorkerIO, n: int, seed: int, indices, beta: float, lr_scale: float, scorers: tuple
    ) -> StepReport:
        report = ppo_step(self, self.task, self.codec, indices, beta, lr_scale, scorers, seed)
        if report.finite:
            self.applied = n
        return report

    def held_out(self, io: WorkerIO, ids=None, indices=None, scorers: tuple = ()) -> tuple[float, int]:
        """The held-out loss on the samples `ids` (every engine's measure), or the reward of the held-out prompts
        `indices`: a PPO run reports both."""
        if ids is not None:
            return super().held_out(io, ids)
        return evaluate(self, self.task, self.codec, indices, scorers)


def prompts_for(task: Task, seed: int, indices, stream: str = "train") -> list[str]:
    """The prompts of these indices, from their own random stream: the evaluation's ("eval") is another draw than
    the training's (a task with few distinct prompts repeats them in both), of the held-out prompts where the task
    has them (a prompt file's)."""
    draw = task.held_out if stream == "eval" and task.held_out is not None else task.prompt
    return [draw(random.Random(f"{stream}:{seed}:{i}")) for i in indices]


def prompt_tokens(prompts: list[str], length: int, codec: Codec) -> torch.Tensor:
    """(B, length) tokens of the run's tokenizer: each prompt's last `length`, left-padded with the end of document
    (what precedes a document in training)."""
    rows = torch.full((len(prompts), length), codec.eos, dtype=torch.long)
    for i, text in enumerate(prompts):
        tokens = torch.tensor(codec.encode(text)[-length:], dtype=torch.long)
        rows[i, length - len(tokens) :] = tokens
    return rows


def response_mask(responses: torch.Tensor, eos: int) -> torch.Tensor:
    """1 for each response token up to and including the first end of document (which ends it), 0 after."""
    ended = (responses == eos).long().cumsum(1)
    return ((ended == 0) | ((ended == 1) & (responses == eos))).float()


def response_texts(responses: torch.Tensor, mask: torch.Tensor, codec: Codec) -> list[str]:
    return [codec.decode([t for t in r[: int(m.sum())].tolist() if t != codec.eos]) for r, m in zip(responses, mask)]


def ppo_step(
    engine, task, codec: Codec, indices, beta: float, lr_scale: float, scorers: tuple, seed: int
) -> StepReport:
    """`indices` number the step's responses: response i answers prompt i // ppo.group (its group's)."""
    cfg, ppo = engine.cfg, engine.cfg.ppo
    started = time.perf_counter()
    engine.model.eval()  # no dropout anywhere: the first update's ratio is 1 (up to the precision's rounding)
    prompts = prompts_for(task, cfg.train.seed, [int(i) // ppo.group for i in indices])
    generator = torch.Generator(engine.device).manual_seed(seed)
    sequences, responses, mask, texts = rollouts(engine, prompts, codec, generator)
    reference, rewarder = scorers
    asked = reference.logprobs.remote(sequences.cpu(), ppo.prompt_len), rewarder.score.remote(prompts, texts)
    critic = ppo.algorithm == "ppo"
    with torch.no_grad(), engine.autocast():
        logits, values = engine.model(sequences, values=critic)
    old_logp = token_logprobs(logits[:, ppo.prompt_len - 1 : -1], responses)
    scores = torch.tensor(wait_for_scores(rewarder, prompts, texts, cfg, asked[1]), device=engine.device)
    ref_logp = ray.get(asked[0]).to(engine.device)
    kl = ((old_logp - ref_logp) * mask).sum(1)  # per response, in nats
    beta = boosted(beta, mean_over_workers(kl, engine.world), ppo.kl_target, ppo.kl_gain)
    if critic:
        rollout = ppo_rollout(engine, values, scores, old_logp, ref_logp, mask, beta)
    else:
        rollout = Rollout(old_logp, ref_logp, mask, group_advantages(scores, ppo.group)[:, None] * mask)
    computing = time.perf_counter()
    stats = update(engine, sequences, responses, rollout, beta, lr_scale, generator)
    n, share = len(indices), len(indices) / ppo.rollouts
    return StepReport(
        finite=math.isfinite(stats["grad_norm"]),
        skipped=False,
        loss=stats["loss"] * share,
        grad_norm=stats["grad_norm"],
        lr=stats["lr"],
        share=n,
        compute_s=time.perf_counter() - computing,
        communication_s=0.0,
        worker_s=time.perf_counter() - started,
        comm_bytes=0,
        dense_bytes=0,
        optimizer_bytes=engine.optimizer_bytes(),
        param_bytes=engine.param_bytes(),
        peak_rss=peak_rss(),
        data=NO_DATA,
        saving=False,  # the actor's to say
        ppo={
            "reward": scores.sum().item(),
            "kl": kl.sum().item(),
            "response_len": mask.sum().item(),
            "kl_coef": beta * n,  # the same on every worker: the step's rollouts' KL, over all of them
            **{k: stats[k] * n for k in LOSSES[ppo.algorithm] + ("clip_fraction", "entropy")},
        },
    )


LOSSES = {"ppo": ("policy_loss", "value_loss"), "grpo": ("policy_loss", "kl_loss")}  # the parts of an update's loss


@dataclass
class Rollout:
    """What the updates learn from, per response token (B, T): the policy's and the reference's log-probabilities
    as sampled, the mask, the advantages; PPO's also the value head's estimates and the returns."""

    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def part(self, rows: torch.Tensor) -> Rollout:
        return Rollout(*(None if (x := getattr(self, f.name)) is None else x[rows] for f in fields(self)))


def ppo_rollout(engine, values, scores, old_logp, ref_logp, mask, beta: float) -> Rollout:
    """PPO's: the KL penalty in each token's reward, GAE over the value head's estimates, the advantages whitened
    over every worker's rollouts."""
    ppo = engine.cfg.ppo
    old_values = values[:, ppo.prompt_len - 1 : -1].float() * mask
    rewards = token_rewards(scores, old_logp, ref_logp, mask, beta)
    advantages, returns = gae(rewards, old_values, mask, ppo.gamma, ppo.lam)
    sums = moments(advantages, mask)
    if engine.world > 1:
        dist.all_reduce(sums)
    return Rollout(old_logp, ref_logp, mask, whiten(advantages, sums, mask), old_values, returns)


def mean_over_workers(x: torch.Tensor, world: int) -> float:
    """The mean of `x` over every worker's entries."""
    sums = torch.stack([x.sum(), torch.tensor(float(len(x)), device=x.device)]).double()
    if world > 1:
        dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def rollouts(engine, prompts: list[str], codec: Codec, generator: torch.Generator):
    """(sequences (B, P + T), responses (B, T), their mask, their texts), sampled by the policy."""
    ppo = engine.cfg.ppo
    with engine.autocast():
        sequences = sample(
            engine.model,
            prompt_tokens(prompts, ppo.prompt_len, codec).to(engine.device),
            ppo.response_len,
            ppo.temperature,
            generator,
        )
    responses = sequences[:, ppo.prompt_len :]
    mask = response_mask(responses, codec.eos)
    return sequences, responses, mask, response_texts(responses.cpu(), mask.cpu(), codec)


def update(engine, sequences, responses, rollout: Rollout, beta: float, lr_scale: float, generator) -> dict:
    """ppo.epochs passes of ppo.minibatches updates; every rank runs as many, so DDP's all-reduces pair up. A
    minibatch's loss is the clipped surrogate plus PPO's value loss or GRPO's KL to the reference."""
    cfg, ppo, p = engine.cfg, engine.cfg.ppo, engine.cfg.ppo.prompt_len
    critic = rollout.values is not None
    parts = LOSSES[ppo.algorithm]
    totals = dict.fromkeys(("loss", *parts, "clip_fraction", "entropy", "lr"), 0.0)
    updates, grad_norm = ppo.epochs * ppo.minibatches, 0.0
    for _ in range(ppo.epochs):
        order = torch.randperm(len(sequences), generator=generator, device=engine.device)
        for rows in order.tensor_split(ppo.minibatches):
            engine.optimizer.zero_grad(set_to_none=True)
            mine = rollout.part(rows)
            with engine.autocast():
                logits, values = engine.ddp(sequences[rows], values=critic)
            logits = logits[:, p - 1 : -1]
            logp = token_logprobs(logits, responses[rows])
            pg, clipped = policy_loss(logp, mine.logprobs, mine.advantages, mine.mask, ppo.clip)
            if critic:
                second = value_loss(values[:, p - 1 : -1].float(), mine.values, mine.returns, mine.mask, ppo.value_clip)
                loss = pg + ppo.value_coef * second
            else:
                second = kl_penalty(logp, mine.ref_logprobs, mine.mask)
                loss = pg + beta * second
            loss.backward()
            clip = cfg.optim.grad_clip or float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(engine.model.parameters(), clip).item()
            if not math.isfinite(grad_norm):  # nobody steps: the coordinator goes back to the last checkpoint
                return totals | {"grad_norm": grad_norm}
            for group, lr in zip(engine.optimizer.param_groups, engine.scheduler.get_last_lr()):
                group["lr"] = lr * lr_scale
            engine.optimizer.step()
            totals["lr"] = engine.optimizer.param_groups[0]["lr"]  # the step's, before the schedule moves on
            with torch.no_grad():
                ent = entropy(logits.detach(), mine.mask).item()
            for key, value in (("loss", loss), (parts[0], pg), (parts[1], second), ("clip_fraction", clipped)):
                totals[key] += float(value.detach()) / updates
            totals["entropy"] += ent / updates
    engine.scheduler.step()
    return totals | {"grad_norm": grad_norm}


@torch.no_grad()
def evaluate(engine, task, codec: Codec, indices, scorers: tuple) -> tuple[float, int]:
    """Sum of the rewards of held-out prompts' responses (sampled at the rollout temperature), and their count."""
    if not len(indices):
        return 0.0, 0
    engine.model.eval()
    prompts = prompts_for(task, engine.cfg.train.seed, indices, stream="eval")
    generator = torch.Generator(engine.device).manual_seed(int(indices[0]))
    _, _, _, texts = rollouts(engine, prompts, codec, generator)
    scores = wait_for_scores(scorers[1], prompts, texts, engine.cfg)
    return float(sum(scores)), len(scores)


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
