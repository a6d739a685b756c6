"""A PPO step as a transaction on the coordinator: Stepper's, with each worker's share of the step's prompts in
place of a data batch (etrain/worker/rollout.py does the work), the KL coefficient the steps adapt, the evaluation
of the policy's mean reward on held-out prompts, and the scorers (the reference model and the reward, actors of
their own: scorers.py) that this stepper starts and stops."""

from __future__ import annotations

import time

import numpy as np
import ray

from etrain.control import scorers
from etrain.control.gather import WorkersLost
from etrain.control.step import Outcome, Position, Stepper, evaluate
from etrain.core.ppo import AdaptiveKL
from etrain.worker.protocol import StepReport


class PPOStepper(Stepper):
    def __init__(self, *args):
        super().__init__(*args)
        ppo = self.cfg.ppo
        self.scorers = scorers.start(self.cfg)
        self.kl = AdaptiveKL(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)
        self.tokens_per_sample = ppo.prompt_len + ppo.response_len

    def run(self, at: Position) -> Outcome:
        started = time.perf_counter()
        workers, n, count = self.team.workers, at.step + 1, self.cfg.ppo.rollouts
        shares = groups_split(at.cursor, count, self.cfg.ppo.group, len(workers))
        faults = self.faults_due(n, at.cursor)
        work = {"beta": self.kl.beta, "lr_scale": self.guards.lr_scale, "scorers": self.scorers}
        refs = [
            w.step.remote(n, work | {"indices": ids}, faults.get(rank))
            for rank, (w, ids) in enumerate(zip(workers, shares))
        ]
        try:
            reports: list[StepReport] = self.team.gather(refs, workers, f"step {n}")
        except WorkersLost as gone:  # the recovery goes back to the last checkpoint (the coordinator's _recover)
            return Outcome(lost=gone.lost, since=started, cause=f"step {n}: {gone.cause}")
        if not all(r.finite for r in reports):
            return Outcome(diverged=True)
        means = {k: sum(r.ppo[k] for r in reports) / count for k in reports[0].ppo}
        extra = {**means, "kl_base": self.kl.beta}
        self.kl.update(means["kl"], count)
        self.commit(at, count, reports, time.perf_counter() - started, extra)
        return Outcome()

    def evaluate(self, faults: dict) -> tuple[float | None, float | None]:
        """The held-out loss (faults injected into the reward's measure alone) and the policy's mean reward."""
        return evaluate(self.team, self.data.eval_ids, {}), self.reward(faults)

    def evaluates_first(self, step: int) -> bool:
        """A run from its base measures the base policy's reward first (once): the rise is measured against it."""
        return step == 0 and not self.log.recorded("eval", 0)

    def check_size(self, workers: int) -> None:
        ppo = self.cfg.ppo
        if workers * ppo.minibatches > ppo.rollouts:
            raise ValueError(
                f"{workers} workers × ppo.minibatches={ppo.minibatches} exceed ppo.rollouts={ppo.rollouts}: every "
                "worker needs a rollout for each of its updates"
            )
        if workers > ppo.prompts_per_step:
            raise ValueError(
                f"{workers} workers exceed the {ppo.prompts_per_step} prompts of a step (ppo.rollouts / ppo.group): "
                "a prompt's group stays on one worker"
            )

    def close(self) -> None:
        for actor in self.scorers:
            ray.kill(actor)

    def reward(self, faults: dict | None = None) -> float:
        """The policy's mean reward on the held-out prompts, split over the members. WorkersLost as evaluate."""
        workers, faults = self.team.workers, faults or {}
        shares = np.array_split(np.arange(self.cfg.ppo.eval_prompts), len(workers))
        refs = [
            w.evaluate.remote({"indices": ids, "scorers": self.scorers}, faults.get(r))
            for r, (w, ids) in enumerate(zip(workers, shares))
        ]
        results = self.team.gather(refs, workers, "reward evaluation")
        return sum(r[0] for r in results) / sum(r[1] for r in results)

    def suspects(self) -> tuple[str, ...]:
        """What a non-finite PPO gradient points at: the value head regresses the reward's scores."""
        last = self.log.latest.get("train", {}).get("reward")
        seen = f" (the last step's mean: {last:.3g})" if last is not None else ""
        return (
            f"check the scale of reward {self.cfg.ppo.reward}'s scores{seen}: the value head learns them, so keep "
            "them within about ±10; or lower optim.lr",
        )

    def state(self) -> dict:
        return {"kl_coef": self.kl.beta}

    def load(self, meta: dict) -> None:
        self.kl.beta = meta.get("kl_coef", self.cfg.ppo.kl_coef)


def groups_split(cursor: int, count: int, group: int, workers: int) -> list[np.ndarray]:
    """The step's responses cursor .. cursor + count, split over the workers in whole groups: a group's responses
    (one prompt's) stay together, as their advantages are measured against each other."""
    if cursor % group:
        raise ValueError(
            f"the run's cursor {cursor} is not a multiple of ppo.group={group}: was ppo.group changed on a resume? "
            "resume with the group the run started with"
        )
    groups = np.arange(cursor, cursor + count).reshape(-1, group)
    return [part.reshape(-1) for part in np.array_split(groups, workers)]
