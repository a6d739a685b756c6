"""Training that starts from a trained model: fine-tuning (LoRA adapters or every weight) and PPO against a
reward."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from etrain.core.config.base import Section


def targeted(name: str, targets: list[str]) -> bool:
    """Whether a module's name is, or ends in, one of `targets` (finetune.lora.targets, also_train)."""
    return any(name == t or name.endswith("." + t) for t in targets)


class LoraConfig(Section):
    rank: int = Field(8, ge=1, description="rank of each adapter's update B A")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: list[str] = Field(
        ["attn.q", "attn.k", "attn.v", "attn.proj"],
        min_length=1,
        description="linear layers that get adapters, by name or its end: attn.q, attn.k, attn.v, attn.proj, mlp.0, "
        "mlp.2 (in every block), blocks.0.attn.q (one), head; Llama's: attn.o, mlp.gate, mlp.up, mlp.down (its "
        "default: attn.q, attn.k, attn.v, attn.o)",
    )
    also_train: list[str] = Field(
        [],
        description="modules trained in full beside the adapters, by name or its end (norm1, norm2, norm: the "
        "LayerNorms); their weights are checkpointed with the adapters",
    )


class FinetuneConfig(Section):
    """Training that starts from a trained model (`etrain finetune --from`): its weights, then LoRA adapters on them
    (only the adapters train) or all of them."""

    base: str | None = Field(None, description="the checkpoint the run starts from (set by etrain finetune)")
    base_digest: str | None = Field(
        None,
        description="sha256 over the base's weights, taken when the run was made: a base that no longer matches "
        "is refused",
    )
    method: Literal["lora", "full"] = Field("lora", description="lora: adapters only; full: every weight trains")
    lora: LoraConfig = LoraConfig()
    adapter: str | None = Field(
        None,
        description="a PEFT LoRA adapter directory the adapters start from, its settings the run's finetune.lora "
        "(set by etrain finetune --adapter)",
    )
    adapter_digest: str | None = Field(
        None, description="sha256 of the adapter's adapter_model.safetensors, taken when the run was made"
    )

    @model_validator(mode="after")
    def _digest_with_base(self) -> FinetuneConfig:
        if self.base is not None and self.base_digest is None:
            raise ValueError(
                "finetune.base needs finetune.base_digest; start fine-tuning runs with `etrain finetune --from`, "
                "which records it"
            )
        if self.adapter is not None and (self.base is None or self.method != "lora" or self.adapter_digest is None):
            raise ValueError(
                "finetune.adapter continues LoRA adapters on a base: start such a run with `etrain finetune --from "
                "BASE --adapter DIR` (finetune.method=lora), which records the adapter's digest"
            )
        return self

    @property
    def lora_on(self) -> bool:
        return self.base is not None and self.method == "lora"


class PPOConfig(Section):
    """Reinforcement learning from a reward (`etrain ppo`, `etrain grpo`): the policy (the fine-tuned model)
    samples responses to the reward task's prompts, the reward scores them, and the policy is updated with a KL
    penalty against the frozen base: PPO's, with a value head and GAE (etrain/core/ppo.py), or GRPO's, with no
    value head, each response's advantage its score against its group's (etrain/core/grpo.py)."""

    algorithm: Literal["ppo", "grpo"] = Field(
        "ppo",
        description="ppo: a value head, GAE, the KL penalty in each token's reward; grpo (DeepSeekMath): ppo.group "
        "responses per prompt, each one's advantage its score normalised over its group, no value head, the KL "
        "to the base in the loss",
    )
    group: int = Field(
        1,
        ge=1,
        description="responses sampled per prompt (GRPO's G, at least 2; a group stays on one worker); "
        "ppo.rollouts counts responses, so a step has ppo.rollouts / ppo.group prompts",
    )
    reward: str | None = Field(
        None,
        description="a built-in task (digits, brackets, length, exact), FILE.py:function or a Hugging Face "
        "sequence-classification directory (a reward model); set by etrain ppo and etrain grpo",
    )
    prompts: str | None = Field(
        None,
        description='a JSON-lines file (local or a URI) of {"prompt": ..., "answer": ...} records the rollouts draw '
        "from, every tenth held out for evaluations; a reward taking (prompt, response, answer) gets the answer; "
        "set by etrain ppo --prompts",
    )
    prompt_len: int = Field(16, ge=1, description="prompts are cut or left-padded (with the separator) to this")
    response_len: int = Field(24, ge=1, description="tokens sampled per response (a separator ends one early)")
    rollouts: int = Field(32, ge=1, description="responses per PPO step, over all workers")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts and evaluations")
    epochs: int = Field(2, ge=1, description="passes of PPO updates over each step's rollouts")
    minibatches: int = Field(2, ge=1, description="updates per pass (each worker splits its rollouts as many ways)")
    clip: float = Field(0.2, gt=0, description="the policy ratio's clip range")
    value_clip: float = Field(0.2, gt=0, description="the value's clip range around the rollout's")
    value_coef: float = Field(0.1, ge=0, description="weight of the value loss beside the policy loss")
    gamma: float = Field(1.0, gt=0, le=1, description="the discount over a response's tokens")
    lam: float = Field(0.95, ge=0, le=1, description="GAE's lambda")
    kl_coef: float = Field(0.05, ge=0, description="the KL penalty's initial coefficient (beta)")
    kl_target: float = Field(6.0, gt=0, description="the per-response KL (nats) the controller holds")
    kl_horizon: int = Field(10_000, ge=1, description="responses over which beta adapts (Ziegler et al.)")
    kl_gain: float = Field(
        4.0,
        ge=0,
        description="a step whose rollouts' KL is above kl_target applies beta × (KL / kl_target)^kl_gain: an "
        "overshoot is met in the step that shows it; 0 = Ziegler's slow law alone",
    )
    eval_prompts: int = Field(64, ge=1, description="held-out prompts whose mean reward each evaluation measures")
    reward_timeout_s: float | None = Field(
        None,
        gt=0,
        description="the most a worker waits for the reward to score its responses (one call at a time serves every "
        "worker); a reward slower than this fails the run naming it; below timeouts.step_s (None: half of it)",
    )

    @model_validator(mode="after")
    def _groups(self):
        if self.algorithm == "grpo" and self.group < 2:
            raise ValueError(
                "ppo.algorithm=grpo normalises each response's score over its prompt's group: set ppo.group to 2 or "
                "more (`etrain grpo` takes 8 unless --group says otherwise)"
            )
        if self.rollouts % self.group:
            raise ValueError(
                f"ppo.rollouts={self.rollouts} is not a multiple of ppo.group={self.group}: a step samples whole "
                "groups; make ppo.rollouts a multiple of it"
            )
        return self

    @property
    def prompts_per_step(self) -> int:
        return self.rollouts // self.group
