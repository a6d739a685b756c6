"""A laid-out rank's part of the state, in and out: its own part by name (what a twin at the same place takes,
`local_state`/`load_local`), and its part cut from a whole model's state (`load_full`: the initial weights, made
tensor by tensor; a data-parallel run's checkpoint, or a layout's from before DCP). Checkpoints of a layout are
written and read in parts with torch DCP (etrain/core/sharded_checkpoint.py); `full_state`, which gathers the whole
model onto one rank, is what the tests and bench/sharded.py compare them with.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from etrain.core.parallel import Replica, shard_of
from etrain.core.sharded_checkpoint import optim_name


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a shard's full tensor (a collective over its TP group: every rank of it must ask)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(replica: Replica, optimizer: torch.optim.Optimizer) -> dict | None:
    """{"model": name -> tensor, "optim": name -> AdamW state} of the whole model, on each replica's first rank
    (stage 0, shard 0, tp_rank 0); None on the others."""
    model = {name: whole(t) for name, t in replica.model.state_dict().items()}
    optim = {}
    for name, p in replica.model.named_parameters():
        if p in optimizer.state and not (replica.tied and name == "head.weight"):  # the tied copy: the embedding's
            optim[name] = {k: whole(v) if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
    mine = {"model": model, "optim": optim}
    if replica.cfg.pp > 1:
        group = replica.mesh["pp"].get_group()
        first = dist.get_global_rank(group, 0)
        parts = [None] * replica.cfg.pp if dist.get_rank() == first else None
        dist.gather_object(mine, parts, dst=first, group=group)
        if parts is None:
            return None
        mine = {key: {k: v for part in parts for k, v in part[key].items()} for key in ("model", "optim")}
    return mine if replica.at.shard == 0 and replica.at.tp_rank == 0 else None


def load_full(replica: Replica, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Each rank takes its part of a whole-model state (full_state's, from any layout). A source that reads a range
    of rows alone (a Hugging Face directory's `rows`) gives a rank holding one range of a tensor's rows only those."""
    source = state["model"]
    with torch.no_grad():
        for name, t in replica.model.state_dict().items():
            rows = _rows(t) if hasattr(source, "rows") else None
            shard_of(t).copy_(source.rows(name, *rows) if rows else _part(source[name], t))
    for name, p in replica.model.named_parameters():
        saved = state["optim"].get(optim_name(name, replica.tied))
        if saved is not None:
            optimizer.state[p] = {k: _held_as(p, v) if torch.is_tensor(v) else v for k, v in saved.items()}


def _rows(like: torch.Tensor) -> tuple[int, int] | None:
    """The rows [start, stop) of the whole tensor this rank holds of `like`, where they are one range: a DTensor
    cut on dim 0 along one mesh dimension (FSDP's chunks, TP's column split), replicated along any other. None
    otherwise (a whole tensor, a row-parallel split on dim 1, TP and FSDP both on dim 0): then the rank cuts its
    part from the whole tensor."""
    if not isinstance(like, DTensor):
        return None
    cut = [(i, p) for i, p in enumerate(like.placements) if not p.is_replicate()]
    if len(cut) != 1 or type(cut[0][1]) is not Shard or cut[0][1].dim != 0:
        return None
    dim = cut[0][0]
    length, ranks = like.shape[0], like.device_mesh.size(dim)
    chunk = -(-length // ranks)  # torch.chunk's, as DTensor's Shard cuts
    start = min(like.device_mesh.get_local_rank(dim) * chunk, length)
    return start, min(start + chunk, length)


def _part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, shaped as `like` is held here: cut locally, as the placements of `like` cut it
    (TP's even chunks, FSDP's dim-0 chunks), without a collective."""
    return _distributed_as(full, like).to_local() if isinstance(like, DTensor) else full


def _distributed_as(full: torch.Tensor, like: DTensor) -> DTensor:
    local = full.to(like.to_local().device)
    return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)


def _held_as(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor as the optimizer holds it beside `p`: a step count as it is, a moment as this
    rank's part, a DTensor beside a DTensor."""
    if not full.dim():
        return full.clone()
    if isinstance(p, DTensor):
        return _distributed_as(full.clone(), p)
    return full.clone().to(p.device)


def local_state(replica: Replica, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's own part: weights and AdamW state by name, local shards as plain tensors. What a rank at the
    same place (stage, shard, tp_rank) of another replica takes to join in its place."""
    model = {name: shard_of(t).detach().cpu().clone() for name, t in replica.model.state_dict().items()}
    optim = {}
    for name, p in replica.model.named_parameters():
        if p in optimizer.state:
            optim[name] = {k: shard_of(v).detach().cpu().clone() for k, v in optimizer.state[p].items()}
    return {"at": replica.at.place, "model": model, "optim": optim}


def load_local(replica: Replica, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Take a local_state of a rank at the same place, in place."""
    mine = replica.at.place
    if tuple(state["at"]) != mine:
        raise ValueError(
            f"a rank at (stage, shard, tp_rank) {tuple(state['at'])} cannot give its state to one at {mine}"
        )
    with torch.no_grad():
        for name, t in replica.model.state_dict().items():
            shard_of(t).copy_(state["model"][name])
    for name, p in replica.model.named_parameters():
        saved = state["optim"].get(name)
        if saved is not None:
            optimizer.state[p] = {k: _local_as(p, v) for k, v in saved.items()}


def _local_as(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    local = local.clone().to(shard_of(p).device)
    if isinstance(p, DTensor) and local.dim():  # FSDP's last shard may be short: the whole shape from `p`
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local
