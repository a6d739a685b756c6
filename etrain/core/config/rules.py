"""The rules that span sections: what one section's choice implies in another, and what combinations a run does
not support. Each section's own rules are its validators; these are `Config`'s.

A rule raises ValueError with the message the user sees (pydantic reports it as `config: ...`). They run in the
order of RULES and the first one broken is the error, so a config that breaks two always names the same one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from etrain.core.comm_model import gradient_sync_s
from etrain.core.config.finetune import targeted
from etrain.core.config.model import ModelConfig
from etrain.core.models import family

if TYPE_CHECKING:
    from etrain.core.config.faults import Fault
    from etrain.core.config.root import Config


# -- implied keys: on the raw tree, before the sections are read ------------------------------------------------


def implied(raw: Any) -> Any:
    """`raw` with the keys other sections imply filled in."""
    return family_lora_targets(deterministic_split(raw))


def deterministic_split(raw: Any) -> Any:
    """train.deterministic means an equal split: balance.enabled follows it, and saying otherwise is an error."""
    if not isinstance(raw, dict) or (raw.get("train") or {}).get("deterministic") is not True:
        return raw
    balance = raw.get("balance") or {}
    if balance.get("enabled") is True:
        raise ValueError(
            "train.deterministic=true splits every step equally: it needs balance.enabled=false (or leave it out)"
        )
    return {**raw, "balance": {**balance, "enabled": False}}


def family_lora_targets(raw: Any) -> Any:
    """LoRA's default targets are the attention's projections of the model's family (its spec's lora_targets: GPT's
    output projection is attn.proj, Llama's attn.o)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        return raw
    try:
        spec = family(raw["model"].get("family", ModelConfig.model_fields["family"].default))
    except ValueError:
        return raw  # the model section's own validation names it
    finetune = dict(raw.get("finetune") or {})
    lora = dict(finetune.get("lora") or {})
    if "targets" not in lora:
        lora["targets"] = list(spec.lora_targets)
    return raw | {"finetune": finetune | {"lora": lora}}


# -- checks: on the validated tree --------------------------------------------------------------------------------


def check(cfg: Config) -> None:
    """Every rule of RULES in turn."""
    for rule in RULES:
        rule(cfg)


def _used(flags: dict[str, bool]) -> str:
    """The names of the flags that are on, joined: what a config uses of what a mode refuses."""
    return ", ".join(name for name, on in flags.items() if on)


def precision_needs_a_gpu(cfg: Config) -> None:
    if cfg.train.precision == "fp16" and cfg.cluster.gpus_per_worker == 0:
        raise ValueError("train.precision=fp16 needs a GPU (cluster.gpus_per_worker > 0); use bf16 on CPU")


def workers_fit(cfg: Config) -> None:
    """The worker counts are ordered (min ≤ num ≤ max) and each worker gets a sample."""
    train, cluster = cfg.train, cfg.cluster
    if train.global_batch < cluster.num_workers:
        raise ValueError(
            f"train.global_batch={train.global_batch} is smaller than "
            f"cluster.num_workers={cluster.num_workers}: every worker needs a sample"
        )
    if cluster.min_workers > cluster.num_workers:
        raise ValueError(
            f"cluster.min_workers={cluster.min_workers} is above cluster.num_workers={cluster.num_workers}"
        )
    if cluster.max_workers is not None and cluster.max_workers < cluster.num_workers:
        raise ValueError(
            f"cluster.max_workers={cluster.max_workers} is below cluster.num_workers={cluster.num_workers}"
        )
    if (cluster.max_workers or 0) > train.global_batch and train.batch_scaling == "constant":
        raise ValueError(
            f"cluster.max_workers={cluster.max_workers} exceeds train.global_batch={train.global_batch}: "
            "every worker needs a sample"
        )


def ps_sends_whole_gradients(cfg: Config) -> None:
    """The parameter servers take whole gradients and run AdamW themselves."""
    if cfg.comm.mode != "ps":
        return
    if cfg.comm.zero or cfg.comm.compression != "none":
        raise ValueError(
            "comm.mode=ps sends whole gradients to the parameter servers: comm.zero and comm.compression apply to "
            "allreduce only"
        )
    if cfg.optim.name != "adamw" or cfg.checkpoint.every_s:
        raise ValueError(
            "comm.mode=ps runs AdamW on its shards and checkpoints at its quiet steps (checkpoint.every): "
            "optim.name=lamb and checkpoint.every_s apply to allreduce only"
        )


def ppo_fits(cfg: Config) -> None:
    """A PPO run starts from a base, takes several updates from one rollout, and sizes its rollouts to its workers
    and its model."""
    if cfg.ppo.reward is None:
        if cfg.ppo.prompts is not None:
            raise ValueError(
                "ppo.prompts are a PPO run's: start it with `etrain ppo --from RUN --reward ... --prompts`"
            )
        return
    if cfg.finetune.base is None:
        raise ValueError("ppo.reward trains a trained model: start PPO runs with `etrain ppo --from RUN`")
    if used := _used(_ppo_refuses(cfg)):
        raise ValueError(
            f"ppo.reward (a PPO run) does not support {used}: several updates per step share one "
            "rollout, which these do not allow for; leave them out"
        )
    if cfg.checkpoint.every == 0:
        raise ValueError(
            "ppo.reward (a PPO run) needs checkpoint.every > 0: a worker lost in a PPO step sends the run back to "
            "its last checkpoint (the survivors may have made some of the step's updates)"
        )
    _ppo_sizes(cfg)


def _ppo_refuses(cfg: Config) -> dict[str, bool]:
    return {
        "comm.mode=ps": cfg.comm.mode == "ps",
        f"comm.compression={cfg.comm.compression}": cfg.comm.compression in ("topk", "powersgd"),
        "train.precision=fp16": cfg.train.precision == "fp16",
        "train.batch_scaling=linear": cfg.train.batch_scaling == "linear",
        "parallel.tp × parallel.pp × parallel.shard > 1": cfg.parallel.ranks > 1,
        "faults of kind slow, nan, spike, degrade or noisy": any(
            f.kind in ("slow", "nan", "spike", "degrade", "noisy") for f in cfg.faults
        ),
    }


def _ppo_sizes(cfg: Config) -> None:
    """The reward's wait within a step, a rollout for every update of every worker, prompt and response in a
    sequence."""
    ppo = cfg.ppo
    if ppo.reward_timeout_s is not None and ppo.reward_timeout_s >= cfg.timeouts.step_s:
        raise ValueError(
            f"ppo.reward_timeout_s={ppo.reward_timeout_s:g} must be below "
            f"timeouts.step_s={cfg.timeouts.step_s:g}: a step waits for its scores"
        )
    most = max(cfg.cluster.num_workers, cfg.cluster.max_workers or 0)
    if ppo.rollouts < most * ppo.minibatches:
        raise ValueError(
            f"ppo.rollouts={ppo.rollouts} is below {most} worker(s) × ppo.minibatches={ppo.minibatches}: every "
            "worker needs a rollout for each of its updates"
        )
    if ppo.prompts_per_step < most:
        raise ValueError(
            f"ppo.rollouts / ppo.group = {ppo.prompts_per_step} prompts a step is below {most} worker(s): a group "
            "stays on one worker, so every worker needs a prompt; raise ppo.rollouts"
        )
    if ppo.prompt_len + ppo.response_len > cfg.model.seq_len:
        raise ValueError(
            f"ppo.prompt_len + ppo.response_len = {ppo.prompt_len + ppo.response_len} exceeds "
            f"model.seq_len={cfg.model.seq_len}"
        )


def lora_fits(cfg: Config) -> None:
    """LoRA's adapters sit on frozen, whole weights, each of a rank below the layer's narrowest side."""
    if not cfg.finetune.lora_on:
        return
    lora = cfg.finetune.lora
    if cfg.comm.mode == "ps":
        raise ValueError(
            "finetune.method=lora trains adapters on frozen weights; comm.mode=ps shards every weight: use "
            "comm.mode=allreduce"
        )
    shapes = cfg.model.linear_shapes()
    narrowest = min((min(s) for n, s in shapes.items() if targeted(n, lora.targets)), default=None)
    if narrowest is not None and lora.rank > narrowest:
        raise ValueError(
            f"finetune.lora.rank={lora.rank} exceeds {narrowest}, the narrowest side of a layer it adapts: an "
            f"update B·A of that layer has rank {narrowest} at most, so a larger rank only adds weights (for a "
            "full-rank update, finetune.method=full costs less)"
        )
    if cfg.model.tie_weights and "head" in lora.targets:
        raise ValueError(
            "finetune.lora.targets has head, whose weight is the embedding's (model.tie_weights): an "
            "adapter there would untie them when merged; leave head out"
        )


def ps_steps_fit(cfg: Config) -> None:
    """The parameter servers' updates depend on timing, and each is one global batch without a loss scaler."""
    if cfg.comm.mode != "ps":
        return
    if cfg.train.deterministic:
        raise ValueError(
            "comm.mode=ps is not repeatable (which update a gradient lands in depends on timing): it cannot be "
            "train.deterministic"
        )
    if cfg.train.batch_scaling == "linear" or cfg.train.precision == "fp16":
        raise ValueError(
            "comm.mode=ps needs train.batch_scaling=constant (a step is one global batch) and no fp16 (the shards "
            "have no loss scaler): use bf16"
        )


def diloco_fits(cfg: Config) -> None:
    if cfg.comm.mode != "diloco":
        return
    refused = {
        "comm.zero": cfg.comm.zero,
        f"comm.compression={cfg.comm.compression}": cfg.comm.compression != "none",
        "train.batch_scaling=linear": cfg.train.batch_scaling == "linear",
        "PPO (ppo.reward)": bool(cfg.ppo.reward),
    }
    if used := _used(refused):
        raise ValueError(
            f"comm.mode=diloco does not support {used}: its workers sync no gradients (only the "
            "pseudo-gradient of each outer step, comm.diloco.bf16 to halve it), keep their whole optimizer "
            "state, and take fixed shares of a fixed batch; leave them out"
        )


def links_fit(cfg: Config) -> None:
    """A simulated link slows data parallelism's gradient all-reduce (and DiLoCo's), and leaves a step its time."""
    links = [f for f in cfg.faults if f.kind == "link"]
    if links and (cfg.comm.mode == "ps" or cfg.parallel.ranks > 1 or cfg.ppo.reward):
        raise ValueError(
            "a link fault models the gradient all-reduce of data parallelism and DiLoCo; comm.mode=ps, "
            "parallel layouts and PPO (ppo.reward) send theirs another way: leave the link fault out"
        )
    for fault in links:
        _link_fits_a_step(cfg, fault)


def _link_fits_a_step(cfg: Config, fault: Fault) -> None:
    """A link so slow that a step's gradient all-reduce alone outlasts timeouts.step_s: every step would time
    out and the run end as if every worker were lost. Dense gradients at the largest world (fp16/bf16 halve
    them; top-k and PowerSGD send dense ones first), DDP's buckets each paying the ring's latency."""
    world = max(cfg.cluster.num_workers, cfg.cluster.max_workers or 0)
    trained = cfg.lora_params() if cfg.finetune.lora_on else cfg.model.param_count()
    grad_bytes = trained * (2 if cfg.comm.compression in ("fp16", "bf16") else 4)
    sync = gradient_sync_s(grad_bytes, cfg.comm.bucket_mb, world, fault.gbps, fault.latency_ms)
    if sync >= cfg.timeouts.step_s:
        raise ValueError(
            f"faults: a link of {fault.gbps:g} Gbit/s and {fault.latency_ms:g} ms a hop makes a step's gradient "
            f"all-reduce ({grad_bytes / 2**20:,.1f} MiB among {world} workers) take about {sync:,.1f} s by the "
            f"ring model, at least timeouts.step_s={cfg.timeouts.step_s:g}: every step would time out. Raise "
            f"timeouts.step_s above {2 * sync + 1:,.0f} (timeouts.join_s above that), or simulate a faster link"
        )


def zero_needs_checkpoints(cfg: Config) -> None:
    if cfg.comm.zero and cfg.checkpoint.every == 0:
        raise ValueError(
            "comm.zero needs checkpoint.every > 0: a lost worker takes its optimizer shard along, and the job goes "
            "back to the last checkpoint"
        )


def ps_splits_the_batch(cfg: Config) -> None:
    if cfg.comm.mode == "ps" and cfg.train.global_batch % cfg.cluster.num_workers:
        raise ValueError(
            f"comm.mode=ps gives each worker train.global_batch / cluster.num_workers samples per push: "
            f"make train.global_batch={cfg.train.global_batch} a multiple of "
            f"cluster.num_workers={cfg.cluster.num_workers}"
        )


def faults_fire(cfg: Config) -> None:
    """A fault that can never fire is a drill that tests nothing: one during an evaluation that never comes, one
    on a rank the run never has."""
    largest = max(cfg.cluster.num_workers, cfg.cluster.max_workers or 0)
    every = cfg.train.eval_every
    for i, fault in enumerate(cfg.faults):
        evaluated = fault.step == cfg.train.steps or (every > 0 and fault.step % every == 0)
        if fault.during == "eval" and not evaluated:
            raise ValueError(
                f"faults[{i}] (during: eval) never fires: step {fault.step} is followed by no evaluation "
                f"(train.eval_every={every}, train.steps={cfg.train.steps})"
            )
        if fault.rank >= largest:
            raise ValueError(
                f"faults[{i}].rank={fault.rank} never fires: the run has at most {largest} worker(s) "
                f"(ranks 0-{largest - 1}; cluster.num_workers, cluster.max_workers)"
            )


def linear_batch_splits(cfg: Config) -> None:
    if cfg.train.batch_scaling == "linear" and cfg.train.global_batch % cfg.cluster.num_workers:
        raise ValueError(
            f"train.batch_scaling=linear needs train.global_batch={cfg.train.global_batch} to be a multiple of "
            f"cluster.num_workers={cfg.cluster.num_workers} (it is the per-worker batch times the workers)"
        )


def layout_fits(cfg: Config) -> None:
    """What a tp × pp × shard replica needs of the model and the batch, and what it does not support yet, by
    name."""
    if cfg.parallel.ranks == 1:
        return
    _layout_shape(cfg)
    unsupported = {
        "comm.mode=ps": cfg.comm.mode == "ps",
        "comm.zero": cfg.comm.zero,
        f"comm.compression={cfg.comm.compression}": cfg.comm.compression != "none",
        "train.precision=fp16": cfg.train.precision == "fp16",
        "train.batch_scaling=linear": cfg.train.batch_scaling == "linear",
        # its trust ratio needs each tensor's whole norm, and a laid-out rank holds a slice of some
        "optim.name=lamb": cfg.optim.name == "lamb",
        "finetune.method=lora": cfg.finetune.lora_on,
        "PPO (ppo.reward)": bool(cfg.ppo.reward),  # its rollouts and updates are data-parallel's
        "comm.mode=diloco": cfg.comm.mode == "diloco",
    }
    if refused := _used(unsupported):
        raise ValueError(
            f"{refused} with parallel.tp × parallel.pp × parallel.shard > 1 is not supported yet; "
            "leave it out, or train with parallel.tp=1 parallel.pp=1 parallel.shard=1"
        )


def _layout_shape(cfg: Config) -> None:
    """Whole heads per tensor rank, a block per stage, a full pipeline, whole replicas and micro-batches."""
    par, m = cfg.parallel, cfg.model
    if m.n_head % par.tp or m.kv_heads % par.tp:
        raise ValueError(
            f"parallel.tp={par.tp} must divide model.n_head={m.n_head} and its key/value heads ({m.kv_heads}): "
            "each tensor-parallel rank holds whole heads"
        )
    if m.n_layer < par.pp:
        raise ValueError(f"parallel.pp={par.pp} exceeds model.n_layer={m.n_layer}: every stage needs a block")
    if par.pp > 1 and par.shard > 1:
        raise ValueError(
            f"parallel.pp={par.pp} with parallel.shard={par.shard} is not supported yet: a pipeline stage's "
            "parameters are not sharded; use parallel.tp with parallel.shard, or parallel.pp alone"
        )
    if cfg.checkpoint.light_every:
        raise ValueError(
            f"checkpoint.light_every={cfg.checkpoint.light_every} with parallel.tp × parallel.pp × "
            f"parallel.shard = {par.ranks} is not supported: a laid-out run's checkpoints are full ones, each rank "
            "writing the tensors it holds (torch DCP, in the background); set checkpoint.light_every=0"
        )
    if par.pp > 1 and par.microbatches < par.pp:
        raise ValueError(
            f"parallel.microbatches={par.microbatches} is below parallel.pp={par.pp}: the pipeline never fills"
        )
    for key, workers in (("num_workers", cfg.cluster.num_workers), ("max_workers", cfg.cluster.max_workers)):
        if workers and (why := par.misfit(workers, cfg.train.global_batch, f"cluster.{key}={workers}")):
            raise ValueError(why)


# In this order: the first rule broken is the error.
RULES = (
    precision_needs_a_gpu,
    workers_fit,
    ps_sends_whole_gradients,
    ppo_fits,
    lora_fits,
    ps_steps_fit,
    diloco_fits,
    links_fit,
    zero_needs_checkpoints,
    ps_splits_the_batch,
    faults_fire,
    linear_batch_splits,
    layout_fits,
)
