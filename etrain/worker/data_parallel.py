"""Data parallelism: every rank a whole model replica, gradients all-reduced by DDP as the backward pass makes
them (compressed by the sync's hook, etrain/worker/compress.py), the optimizer state whole or ZeRO-1's shard."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from etrain.core.models.shared import LanguageModel
from etrain.core.optim import (
    make_optimizer,
    make_param_groups,
    optimizer_class,
    optimizer_defaults,
)
from etrain.worker import zero_state
from etrain.worker.compress import GradSync
from etrain.worker.engine import Engine, snapshot
from etrain.worker.injection import Injected


class DataParallel(Engine):
    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        self.ddp: DDP | LanguageModel | None = None  # what the step calls: the model, wrapped in a group of two or more
        self.sync: GradSync | None = None  # the DDP communication hook; keeps top-k residuals across groups
        self.sharded = False  # the optimizer is ZeRO-1's, holding this rank's shard of the state

    def join(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        if world == 1:  # alone, DDP would only copy gradients into buckets and back: slower, nothing gained
            self.ddp = self.model
            if self.sync:  # and nothing is compressed: top-k's residuals have no one to go to
                self.sync.drop()
            return
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # Buffers (rotary tables) are the same everywhere by construction: no broadcast each forward.
        self.ddp = DDP(
            self.model, device_ids=device_ids, bucket_cap_mb=self.cfg.comm.bucket_mb, forward_sync_buffers=False
        )
        comm, start = self.cfg.comm, self.cfg.compress_start()
        self.sync = self.sync or GradSync(comm.compression, comm.topk_ratio, comm.powersgd_rank, start)
        self.sync.register(self.ddp)
        self.sync.regroup(rank, world, list(self.model.named_parameters()), self.applied)
        if comm.zero:
            self._shard_optimizer()

    def leave(self, failed: bool) -> None:
        """A ZeRO-1 shard is useless without its group: the optimizer state is then incomplete until `load`
        gives a whole one, and this worker no state source. After a failed collective the coordinator loads
        every survivor anyway."""
        self.ddp = None  # it holds the group
        if self.sharded and not failed:
            self.set_optimizer(make_optimizer(self.model, self.cfg.optim))
            self.sharded, self.applied = False, -1
        if not failed:
            self.rank, self.world = -1, 0

    def forward_backward(self, rows: torch.Tensor, global_batch: int, injected: Injected) -> tuple[float, None]:
        """Micro-batches accumulate; only the last one's backward syncs, bucket by bucket as it goes. Each sample's
        loss weighs 1/global_batch however the batch is split, and DDP averages over the world, so the update
        equals the single-process update on the whole global batch for any split."""
        quiet = nullcontext if self.world == 1 else self.ddp.no_sync
        losses = self.backward_chunks(self.ddp, rows, global_batch / self.world, injected, quiet)
        return sum(loss / self.world for loss in losses), None

    def state(self) -> dict | None:
        """With ZeRO-1 every member must call this together (the shards are gathered to rank 0); only rank 0
        returns the state, the others None."""
        if self.sharded:
            self.optimizer.consolidate_state_dict(to=0)
            if self.rank != 0:
                return None
        state = self.whole_state()
        if self.sharded:  # torch keeps the gathered shards on rank 0 until the next gathering: ZeRO's saving gone
            self.optimizer._all_state_dicts = []
        return state

    def load(self, state: dict, step: int) -> None:
        """In a group with ZeRO-1, keep only this rank's shard of the optimizer state; outside one, all of it."""
        self.applied = step
        if self.sync:  # top-k's unsent gradient: a checkpoint's goes with its state, this worker's may not
            self.sync.loaded(step, state.get("residuals"))
            if self.world > 1:  # in a group already (a resume, a rollback): this rank's now
                self.sync.regroup(self.rank, self.world, list(self.model.named_parameters()), step)
            elif self.world == 1:
                self.sync.drop()
        self.load_whole(state, step)
        self.sharded = False
        if self.cfg.comm.zero and self.world > 1:
            self._shard_optimizer()

    def checkpoint_parts(self, level: str, path: str) -> tuple[dict, dict | None]:
        """Rank 0 writes the weights, scheduler and scaler; the optimizer state is rank 0's, or under ZeRO-1 each
        rank writes its own shard; with top-k every rank writes its residuals too (full saves)."""
        lead = self.rank <= 0
        weights = self.weights() if lead else None
        parts: dict = {}
        if level != "full":
            return parts, weights
        if self.sharded:
            parts[f"optim-{max(self.rank, 0):03d}.pt"] = zero_state.local_part(self.optimizer)
            if lead:
                parts["optim-groups.pt"] = zero_state.param_groups(self.optimizer)
        elif lead:
            parts["optim.pt"] = snapshot(self.optimizer.state_dict())
        if lead:
            parts["extra.pt"] = snapshot(self.schedule_state())
        if self.world > 1 and self.sync and self.sync.mode == "topk":  # every rank, so a rank's file is its own
            parts[f"residual-{self.rank:03d}.pt"] = self.sync.saved(list(self.model.named_parameters()), self.applied)
        return parts, weights

    def held_optimizer(self) -> torch.optim.Optimizer:
        """ZeRO-1 holds 1/world of the state, in the optimizer it wraps."""
        return self.optimizer.optim if self.sharded else self.optimizer

    def _shard_optimizer(self) -> None:
        """ZeRO-1 over the current group: keep only this rank's shard of the optimizer state.
        The full state (from a checkpoint, a peer, or this worker) is re-partitioned on every join."""
        # ~1 s to import (it brings FSDP, DTensor): comm.zero only
        from torch.distributed.optim import ZeroRedundancyOptimizer

        full = self.optimizer.state_dict()
        # ZeRO-1 gives each rank whole parameters: LAMB's per-tensor trust ratio is the same as unsharded
        sharded = ZeroRedundancyOptimizer(
            make_param_groups(self.model, self.cfg.optim),
            optimizer_class=optimizer_class(self.cfg.optim),
            **optimizer_defaults(self.cfg.optim),
        )
        sharded.load_state_dict(full)
        self.set_optimizer(sharded)
        self.sharded = True
