"""Training worker: one Ray actor, one model replica, one rank of the process group.

A worker is built (torch imported, model and optimizer made, data opened)
before it joins a process group, so joining is cheap: the coordinator keeps
such workers warm in a pool (actors/pool.py) and re-forms groups of live ones.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from datetime import timedelta

import numpy as np
import ray
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from app.checkpoint import deserialize, serialize
from app.config import Config
from app.model import GPT
from app.optim import make_optimizer, make_scheduler
from pipelines.order import Layout, take
from pipelines.shards import ShardReader
from pipelines.stream import StreamingReader


def step_seed(seed: int, step: int, rank: int) -> int:
    """RNG state as a pure function of (seed, step, rank): nothing to checkpoint, exact on resume."""
    return (seed * 1_000_003 + step * 7_919 + rank) % 2**63


class TrainWorker:
    def __init__(self, cfg_dict: dict, manifest: str):
        self.cfg = cfg = Config.model_validate(cfg_dict)
        torch.set_num_threads(cfg.cluster.cpus_per_worker)
        self.device = torch.device("cuda" if cfg.cluster.gpus_per_worker > 0 else "cpu")
        torch.manual_seed(cfg.train.seed)  # same initial weights on every worker
        self.model = GPT(cfg.model).to(self.device)
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.scheduler = make_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.train.precision == "fp16")
        self.manifest = manifest
        self.train_data: StreamingReader | None = None  # set by attach_cache
        self.eval_data = ShardReader(manifest, "eval", cfg.data.cache_shards)  # small, read directly
        self.ddp: DDP | GPT | None = None
        self._store: dist.TCPStore | None = None
        self.rank, self.world = -1, 0
        self.applied = 0  # optimizer steps in this worker's state: which step it can resume from

    def info(self) -> dict:
        node = ray.get_runtime_context().get_node_id()
        return {"pid": os.getpid(), "node": node, "params": self.model.num_params(), "applied": self.applied}

    def warm_up(self) -> None:
        """One forward/backward on a dummy batch, so a pool worker's first real step runs at full
        speed (kernel selection, allocator, autograd threads); its state is untouched."""
        idx = torch.zeros((self.cfg.train.micro_batch, self.cfg.model.seq_len), dtype=torch.long, device=self.device)
        with self._autocast():
            _, loss = self.model(idx, idx)
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)

    def attach_cache(self, cache, layout: Layout, cursor: int | None = None) -> None:
        """Read training shards through this node's cache (one ShardCache actor per node).

        With `cursor` (a pool worker waiting to join), open the shard read there now, so the
        first step after joining does not pay for the first call to the cache."""
        if self.train_data is not None:
            self.train_data.close()
        self.train_data = StreamingReader(self.manifest, layout, cache)
        if cursor is not None:
            self.train_data.get(take(layout, cursor, 1), cursor)

    def host_store(self) -> tuple[str, int]:
        """Serve the TCPStore the group meets at (rank 0 of a generation does this)."""
        timeout = timedelta(seconds=self.cfg.timeouts.join_s)
        self._store = dist.TCPStore(ray.util.get_node_ip_address(), 0, is_master=True, wait_for_workers=False, timeout=timeout)
        return self._store.host, self._store.port

    def join(self, rank: int, world: int, host: str, port: int, generation: int) -> None:
        """Enter the process group of `generation` (a fresh store prefix per membership)."""
        timeouts = self.cfg.timeouts
        store = self._store if rank == 0 else dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeouts.join_s))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"gen{generation}/", store), rank=rank, world_size=world,
            timeout=timedelta(seconds=timeouts.collective_s),
        )
        self.rank, self.world = rank, world
        # Alone, DDP would only copy gradients into buckets and back: measurably slower, nothing gained.
        self.ddp = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None) if world > 1 else self.model

    def train_step(self, step: int, ids: np.ndarray, global_batch: int, cursor: int, fault: str | None = None) -> dict:
        """This worker's share of one optimizer step: forward/backward, all-reduce, clip, update.

        Each sample's loss weighs 1/global_batch however the batch is split, and
        DDP averages over the world, so the update equals the single-process
        update on the whole global batch for any split.
        """
        started = time.perf_counter()
        if fault:
            inject(fault)
        torch.manual_seed(step_seed(self.cfg.train.seed, step, self.rank))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        rows, data = self.train_data.get(ids, cursor)
        chunks = self._tensor(rows).split(self.cfg.train.micro_batch)
        loss_sum = 0.0
        for i, chunk in enumerate(chunks):
            sync = nullcontext() if i == len(chunks) - 1 or self.world == 1 else self.ddp.no_sync()
            with sync:
                with self._autocast():
                    _, loss = self.ddp(chunk[:, :-1], chunk[:, 1:])
                weighted = loss * len(chunk) / global_batch
                self.scaler.scale(weighted * self.world).backward()
            loss_sum += weighted.item()
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg.optim.grad_clip or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip).item()
        # The linear scaling rule (train.batch_scaling=linear): lr grows with the batch. 1 at constant batch.
        scale = global_batch / self.cfg.train.global_batch
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr * scale
        self.scaler.step(self.optimizer)
        self.scaler.update()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.applied = step + 1
        return {"loss": loss_sum, "grad_norm": grad_norm, "lr": lr, "samples": len(ids), "compute_s": time.perf_counter() - started, "data": data}

    @torch.no_grad()
    def evaluate(self, ids: np.ndarray) -> tuple[float, int]:
        """Sum of per-sample mean losses over `ids` (held-out split), and their count."""
        self.model.eval()
        total = 0.0
        for chunk in self._tensor(self.eval_data.get(ids)).split(self.cfg.train.micro_batch):
            with self._autocast():
                _, loss = self.model(chunk[:, :-1], chunk[:, 1:])
            total += loss.item() * len(chunk)
        return total, len(ids)

    def state(self) -> bytes:
        """Model, optimizer, scheduler and scaler state, serialised for a checkpoint."""
        return serialize({
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        })

    def load_state(self, data: bytes, step: int) -> None:
        """Take a checkpoint's or a live peer's state, which is at `step`."""
        state = deserialize(data)
        self.applied = step
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def flat_grad(self) -> torch.Tensor:
        """The synchronised gradient of the last step (for the gradient-equality check)."""
        return torch.cat([p.grad.detach().flatten().cpu() for p in self.model.parameters()])

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.ddp, self.rank, self.world = None, -1, 0

    def _tensor(self, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(rows.astype(np.int64)).to(self.device, non_blocking=True)

    def _autocast(self):
        if self.cfg.train.precision == "fp32":
            return nullcontext()
        dtype = torch.bfloat16 if self.cfg.train.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)


def inject(fault: str) -> None:
    """Failure injection (config `faults`): die like a lost node, or hang like a stuck one."""
    if fault == "kill":
        os._exit(1)
    if fault == "hang":
        time.sleep(10**6)


def spawn(cfg: Config, manifest: str, count: int) -> list:
    """Start `count` worker actors; they build their models in parallel."""
    cluster = cfg.cluster
    remote = ray.remote(TrainWorker).options(num_cpus=cluster.cpus_per_worker, num_gpus=cluster.gpus_per_worker, max_restarts=0)
    return [remote.remote(cfg.model_dump(), manifest) for _ in range(count)]


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
