"""The root of the tree: `Config` composes one section per component, and says what the run as a whole is (its
identity, its YAML) and what its sections mean together at run time (the batch at a world size, DiLoCo's windows)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml
from pydantic import Field, model_validator

from etrain.core.config import memory, rules
from etrain.core.config.base import Section
from etrain.core.config.checkpoint import CheckpointConfig, RunConfig
from etrain.core.config.cluster import ClusterConfig, TimeoutConfig
from etrain.core.config.data import DataConfig, PrepareConfig
from etrain.core.config.faults import Fault, HealthConfig
from etrain.core.config.finetune import FinetuneConfig, PPOConfig
from etrain.core.config.model import ModelConfig, family_keys
from etrain.core.config.parallel import BalanceConfig, CommConfig, ParallelConfig
from etrain.core.config.training import OptimConfig, TrainConfig

# Keys that came after runs were made, left out of a run's identity at their default (None)
LATER = ("finetune.adapter", "finetune.adapter_digest", "ppo.prompts")
# What a resume may change: how, where and how long a run goes on (and how gradients travel); never the
# model, data or optimizer.
RESUMABLE = (
    "train.deterministic",
    "train.steps",
    "train.eval_every",
    "train.eval_samples",
    "checkpoint",
    "cluster",
    "timeouts",
    "run",
    "prepare",
    "faults",
    "health",
    "balance",
    "comm",
    "parallel",  # a layout changes where the model's parts live, not what is trained: resumable in any other
)


class Config(Section):
    """The whole tree. Its field order is config.yaml's and the hash's: a new section goes at the end."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    prepare: PrepareConfig = PrepareConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    comm: CommConfig = CommConfig()
    balance: BalanceConfig = BalanceConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    cluster: ClusterConfig = ClusterConfig()
    parallel: ParallelConfig = ParallelConfig()
    finetune: FinetuneConfig = FinetuneConfig()
    ppo: PPOConfig = PPOConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    health: HealthConfig = HealthConfig()
    run: RunConfig = RunConfig()
    faults: list[Fault] = Field([], description="injected failures (testing); see Fault")

    @model_validator(mode="before")
    @classmethod
    def _implied(cls, raw: Any) -> Any:
        """Keys one section's choice implies in another, filled in before the sections are read (rules.py)."""
        return rules.implied(raw)

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        """The rules that span sections (rules.py); a single section's own rules are its validators."""
        rules.check(self)
        return self

    def hash(self) -> str:
        """Identity of what is trained: everything but the RESUMABLE keys."""
        body = self.model_dump()
        # the keys of other families (unset) are not this run's: a run's identity stays what it was before they
        # came, and the default family's (gpt) what it was before there were families
        for key in family_keys() - set(self.model.spec.keys):
            body["model"].pop(key)
        if self.model.family == ModelConfig.model_fields["family"].default:
            body["model"].pop("family")
        for key in LATER:  # came after runs were made: left out at their default, so those runs' identity holds
            section, _, leaf = key.partition(".")
            if body[section][leaf] is None:
                body[section].pop(leaf)
        for key in RESUMABLE:
            section, _, leaf = key.partition(".")
            body[section].pop(leaf) if leaf else body.pop(section)
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)

    def batch_at(self, world: int) -> int:
        """Samples per optimizer step with `world` workers."""
        if self.train.batch_scaling == "constant":
            return self.train.global_batch
        return self.train.global_batch // self.cluster.num_workers * world

    def most_per_step(self) -> int:
        """The most samples one step can take: a PPO step's rollouts, the global batch, or with
        train.batch_scaling=linear the batch of 65,536 workers (no group is larger). A checkpoint's cursor is held to
        its steps times this: a cursor beyond it was not written by a run of this config."""
        if self.ppo.reward is not None:
            return self.ppo.rollouts
        return self.train.global_batch if self.train.batch_scaling == "constant" else self.batch_at(65536)

    def compress_start(self) -> int:
        """Steps of plain all-reduce before top-k or PowerSGD compress: comm.compress_start, or 20% of the run (1-bit
        Adam's 15-25%: early gradients change fast, and what compression holds back then arrives stale)."""
        start = self.comm.compress_start
        return start if start is not None else max(2, round(0.2 * self.train.steps))

    @property
    def window(self) -> int:
        """Steps from one outer step to the next: DiLoCo's inner steps; 1 in the other modes."""
        return self.comm.diloco.inner_steps if self.comm.mode == "diloco" else 1

    def outer_step(self, step: int) -> bool:
        """Whether `step` ends a window (every step does outside DiLoCo): the workers then hold one model, which is
        what evaluations and checkpoints see and where membership changes land."""
        return step % self.window == 0 or step == self.train.steps

    def reward_timeout_s(self) -> float:
        """How long a PPO worker waits for its scores: ppo.reward_timeout_s, or half a step."""
        return self.ppo.reward_timeout_s or self.timeouts.step_s / 2

    def lora_params(self) -> int:
        """Parameters of the LoRA adapters this config puts on the model (0 without LoRA); memory.py."""
        return memory.lora_params(self)

    def worker_memory(self) -> int:
        """About the bytes one worker (one rank) needs: the sum of rank_memory."""
        return memory.worker_memory(self)

    def rank_memory(self) -> dict[str, int]:
        """About the bytes one rank holds, by part, in this run's layout; the model is memory.py's."""
        return memory.rank_memory(self)
