"""How one model replica is laid out over tp × pp × shard ranks: the mesh, the tensor-parallel plan, the pipeline
stages, the parameter sharding (FSDP2), and the gradient sync and clipping that the layout needs.

torchtitan's split: the model (etrain/core/models/) knows nothing of ranks; this module cuts it up (TP, then FSDP
over the shard dimension, per block and at the root); the step drives the schedule. A rank cuts the model's
structure (built on the meta device) and then gives its part values (model.InitialWeights, tensor by tensor), so
no rank holds the whole model and the initial weights of any layout are those of the unsplit model. Rank order:
ParallelConfig.place. Replicas are HSDP's replicate dimension: their gradients are all-reduced here, shard
by shard, each weighted by the replica's share of the global batch, so that replicas come and go.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from etrain.core.config import ParallelConfig
from etrain.core.models.shared import LanguageModel, next_token_loss

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def make_mesh(world: int, cfg: ParallelConfig, device_type: str) -> DeviceMesh:
    """The 4D mesh over the default process group: (dp, pp, shard, tp), tp fastest.

    DTensor caches sharding decisions keyed by meshes that compare equal by shape and root ranks alone, and the
    specs it hands back hold the mesh of the first call, with its process groups. torch numbers groups afresh in
    each generation, so a rank re-formed at an equal mesh (a survivor renumbered, a replica re-joined) would reach
    a stale group's name: gone ("Could not resolve the process group"), or worse, another group of the new
    generation. The caches go with the groups."""
    forget_sharding_caches()
    shape = (world // cfg.ranks, cfg.pp, cfg.shard, cfg.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp", "pp", "shard", "tp"))


def forget_sharding_caches() -> None:
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def stage_layers(n_layer: int, pp: int) -> list[range]:
    """The blocks of each stage, as even as they go; the first and last stages also hold the embedding and the
    head, so the spare blocks of an uneven split go to the middle stages first."""
    base, spare = divmod(n_layer, pp)
    order = sorted(range(pp), key=lambda s: (s in (0, pp - 1), s))  # middle stages first
    counts = [base + (order.index(s) < spare) for s in range(pp)]
    starts = [sum(counts[:s]) for s in range(pp)]
    return [range(starts[s], starts[s] + counts[s]) for s in range(pp)]


def keep_stage(model: LanguageModel, stage: int, pp: int) -> LanguageModel:
    """Drop what `stage` does not compute (torchtitan's pipeline_module_split). Parameter names stay those of the
    whole model, so checkpoints written by any layout name every tensor alike."""
    keep = stage_layers(len(model.blocks), pp)[stage]
    for name in list(model.blocks):
        if int(name) not in keep:
            del model.blocks[name]
    if stage > 0:
        model.embed = model.pos = None
    if stage < pp - 1:
        model.norm = model.head = None
    return model


def shard_tensors(model: LanguageModel, tp_mesh: DeviceMesh) -> LanguageModel:
    """Megatron's plan on each block, as the family's spec names its layers (tp_plan): q, k, v and the MLP's first
    layer (Llama's gate and up) split by output column (each rank computes whole heads: n_head / tp of them, and
    n_kv_head / tp key/value heads), the attention's output projection and the MLP's last layer split by input row,
    their partial sums all-reduced. Embedding, norms and head stay whole on every rank of the TP group."""
    plan = {}
    for name in model.blocks:
        for part, style in model.cfg.spec.tp_plan.items():
            plan[f"blocks.{name}.{part}"] = ColwiseParallel() if style == "col" else RowwiseParallel()
    return parallelize_module(model, tp_mesh, plan)


def shard_parameters(model: LanguageModel, shard_mesh: DeviceMesh, param_dtype: torch.dtype | None) -> LanguageModel:
    """FSDP2 over the shard dimension, torchtitan's way: each block a unit (its parameters gathered for its forward
    and backward, then freed), the root the rest (embedding, final norm, head). Gradients are reduce-scattered as
    their mean over the shard ranks, in fp32 whatever `param_dtype` (bf16 on a GPU) computes in."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in model.blocks.values():
        fully_shard(block, mesh=shard_mesh, mp_policy=policy)
    return fully_shard(model, mesh=shard_mesh, mp_policy=policy)


class _StageForward(nn.Module):
    """The stage's forward as PipelineStage calls it: tokens or hidden states in, hidden states or logits out."""

    def __init__(self, model: LanguageModel):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.logits(x)


def make_schedule(model: LanguageModel, mesh: DeviceMesh, cfg: ParallelConfig, device: torch.device):
    stage = cfg.place(dist.get_rank()).stage
    pipe = PipelineStage(_StageForward(model), stage, cfg.pp, device, group=mesh["pp"].get_group())
    return SCHEDULES[cfg.schedule](pipe, n_microbatches=cfg.microbatches, loss_fn=next_token_loss, scale_grads=True)


class TiedGroups:
    """With pp > 1 the tied embedding (first stage) and head (last stage) are two copies: their gradients are summed
    between the two stages (Megatron's finalize_model_grads), so both copies take the same update."""

    def __init__(self, mesh: DeviceMesh, cfg: ParallelConfig):
        self.group = None
        ranks = mesh.mesh  # (dp, pp, shard, tp) -> global rank
        me = dist.get_rank()
        for replica in range(ranks.shape[0]):
            for shard in range(ranks.shape[2]):
                for tp_rank in range(ranks.shape[3]):
                    pair = [int(ranks[replica, 0, shard, tp_rank]), int(ranks[replica, -1, shard, tp_rank])]
                    group = dist.new_group(pair)  # every rank creates every group, in one order
                    if me in pair:
                        self.group = group

    def sync(self, model: LanguageModel) -> None:
        tied = model.embed if model.embed is not None else model.head
        dist.all_reduce(tied.weight.grad, group=self.group)


def tied_across_stages(model_cfg, cfg: ParallelConfig) -> bool:
    return model_cfg.tie_weights and cfg.pp > 1


def shard_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: its shard of a DTensor, or `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def sync_replicas(model: nn.Module, mesh: DeviceMesh, weight: float) -> None:
    """Sum each replica's gradient times its share of the global batch (`weight`) over the replicas, the dp
    dimension only, in one flat buffer: replicas of unequal shares still give the whole batch's mean gradient."""
    if mesh["dp"].size() == 1:
        return
    grads = [shard_of(p.grad) for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat *= weight
    dist.all_reduce(flat, group=mesh["dp"].get_group())
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grads(model: LanguageModel, max_norm: float, mesh: DeviceMesh, tied: bool) -> float:
    """The global gradient norm of the whole model, and clipping to `max_norm` as torch's clip_grad_norm_ does.

    Each tensor counts once: the squares of a tensor split over mesh dimensions (TP, shard) are summed over those
    dimensions' groups, a tensor whole on every rank of a group is not; stages add up; the head of a tied pair is
    the embedding's second copy."""
    device = shard_of(next(model.parameters())).device  # a collective's tensors live where the backend reads them
    squares: dict[tuple[str, ...], torch.Tensor] = {}  # by the mesh dimensions the tensors are split over
    for name, p in model.named_parameters():
        if p.grad is None or (tied and name == "head.weight"):
            continue
        split = split_over(p.grad)
        squares.setdefault(split, torch.zeros((), dtype=torch.float64, device=device))
        squares[split] += shard_of(p.grad).double().pow(2).sum()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for split in sorted(squares):  # the same keys in the same order on every rank of a stage
        for dim in split:
            dist.all_reduce(squares[split], group=mesh[dim].get_group())
        total += squares[split]
    if mesh["pp"].size() > 1:
        dist.all_reduce(total, group=mesh["pp"].get_group())
    norm = total.sqrt().item()
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                shard_of(p.grad).mul_(coef)
    return norm


def split_over(t: torch.Tensor) -> tuple[str, ...]:
    """The mesh dimensions a DTensor is split over (none for a plain tensor, or one replicated on its mesh). FSDP
    over TP's column shards splits them in strides (`_StridedShard`), which is_shard() does not count."""
    if not isinstance(t, DTensor):
        return ()
    names = t.device_mesh.mesh_dim_names
    return tuple(names[i] for i, placement in enumerate(t.placements) if not placement.is_replicate())


def collective_failed(e: BaseException) -> bool:
    """A failed collective: torch's own error type, or gloo's (a RuntimeError that names it)."""
    return isinstance(e, dist.DistError) or any(k in str(e) for k in ("gloo/", "NCCL", "ProcessGroup"))


class ReplicaBroken(RuntimeError):
    """A collective among one replica's ranks failed: a rank of it is gone, and the replica with it."""


class Replica:
    """One rank's part of a model replica laid out as `cfg` says, and the collectives its step needs."""

    def __init__(
        self,
        model: LanguageModel,
        mesh: DeviceMesh,
        cfg: ParallelConfig,
        device: torch.device,
        param_dtype: torch.dtype | None = None,
    ):
        """`param_dtype`: what a sharded replica computes in (FSDP2's mixed precision; None: the parameters')."""
        self.cfg, self.mesh = cfg, mesh
        self.at = cfg.place(dist.get_rank())
        self.tied = tied_across_stages(model.cfg, cfg)
        if self.tied:  # the last stage keeps its own copy of the tied weight
            model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
        keep_stage(model, self.at.stage, cfg.pp)
        self.model = shard_tensors(model, mesh["tp"]) if cfg.tp > 1 else model
        if cfg.shard > 1:
            self.model = shard_parameters(self.model, mesh["shard"], param_dtype)
        self.schedule = make_schedule(self.model, mesh, cfg, device) if cfg.pp > 1 else None
        self.tied_groups = TiedGroups(mesh, cfg) if self.tied else None
        self.weight = 1 / mesh["dp"].size()  # this replica's share of the global batch

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, weight: float | None = None, chunk: int = 0) -> float:
        """The replica's batch, forward and backward: the mean loss over the global batch, known on every rank.

        `weight`: this replica's share of the global batch (equal shares if None); `chunk`: without a pipeline,
        the batch runs in micro-batches of this many samples, gradients accumulating (0: all at once). Each of the
        replica's shard ranks computes its part of the batch (an equal one: ParallelConfig.per_replica)."""
        self.weight = 1 / self.mesh["dp"].size() if weight is None else weight
        if self.cfg.shard > 1:
            x, y = x.chunk(self.cfg.shard)[self.at.shard], y.chunk(self.cfg.shard)[self.at.shard]
        try:
            mean = self._own_batch(x, y, chunk)
        except RuntimeError as e:  # only the replica's own ranks take part up to here
            if not collective_failed(e):
                raise
            raise ReplicaBroken(f"a rank of replica {self.at.replica} failed in its forward or backward: {e}") from e
        return self._over_replicas(mean)

    def _own_batch(self, x: torch.Tensor, y: torch.Tensor, chunk: int) -> torch.Tensor:
        if self.schedule is None:
            mean = torch.zeros((), device=x.device)
            chunks = list(zip(x.split(chunk or len(x)), y.split(chunk or len(x))))
            for i, (xs, ys) in enumerate(chunks):
                if self.cfg.shard > 1:  # FSDP reduce-scatters the gradient once, after the last micro-batch
                    self.model.set_requires_gradient_sync(i == len(chunks) - 1)
                _, loss = self.model(xs, ys)
                part = loss * (len(xs) / len(x))
                part.backward()
                mean += part.detach().float()
            if self.cfg.shard > 1:  # each shard rank's mean over its part: the replica's is their mean
                dist.all_reduce(mean, group=self.mesh["shard"].get_group())
                mean /= self.cfg.shard
        else:
            losses = []
            first, last = self.at.stage == 0, self.at.stage == self.cfg.pp - 1
            self.schedule.step(*([x] if first else []), target=y if last else None, losses=losses if last else None)
            mean = torch.stack(losses).float().mean().detach() if last else torch.zeros((), device=x.device)
            dist.all_reduce(mean, group=self.mesh["pp"].get_group())  # only the last stage's is non-zero
        return mean

    def sync_and_clip(self, max_norm: float) -> float:
        if self.tied_groups:
            self.tied_groups.sync(self.model)
        sync_replicas(self.model, self.mesh, self.weight)
        return clip_grads(self.model, max_norm, self.mesh, self.tied)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, chunk: int) -> float:
        """The mean loss over this replica's `x`, forward only: hidden states go from stage to stage by
        send and receive, micro-batch by micro-batch; known on every rank of the replica."""
        try:
            return self._evaluate(x, y, chunk)
        finally:
            if isinstance(self.model, FSDPModule):
                # FSDP's root keeps the parameters it gathered after a forward alone (a backward would reshard
                # them): until then they are not the tensors the optimizer's state is keyed by, and a save would
                # leave the embedding's and final norm's moments out
                self.model.reshard()

    def _evaluate(self, x: torch.Tensor, y: torch.Tensor, chunk: int) -> float:
        pp = self.mesh["pp"].get_group() if self.cfg.pp > 1 else None
        first, last = self.at.stage == 0, self.at.stage == self.cfg.pp - 1
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for xs, ys in zip(x.split(chunk), y.split(chunk)):
            if first:
                h, _ = self.model(xs)  # through forward: FSDP gathers the root's parameters there
            else:
                h = torch.empty((*xs.shape, self.model.cfg.d_model), device=xs.device)
                dist.recv(h, group_src=self.at.stage - 1, group=pp)
                h = self.model.logits(h)
            if not last:
                dist.send(h.float().contiguous(), group_dst=self.at.stage + 1, group=pp)
            else:
                total += next_token_loss(h, ys).double() * len(xs)
        if pp is not None:
            dist.all_reduce(total, group=pp)  # only the last stage's is non-zero
        return total.item() / len(x)

    def _over_replicas(self, mean: torch.Tensor) -> float:
        """Each replica's mean weighed by its share, summed over the replicas."""
        if self.mesh["dp"].size() > 1:
            mean = mean * self.weight
            dist.all_reduce(mean, group=self.mesh["dp"].get_group())
        return mean.item()
