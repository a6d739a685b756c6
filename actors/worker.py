"""Training worker: one Ray actor, one rank of the process group: a whole model replica, or with a layout
(parallel.tp × parallel.pp > 1) one rank's part of one (app/core/parallel.py).

A worker is built (torch imported, model and optimizer made, data opened)
before it joins a process group, so joining is cheap: the coordinator keeps
such workers warm in a pool (actors/pool.py) and re-forms groups of live ones.
A laid-out worker takes its part of the model when it joins, at the (stage, shard)
its rank gives, and keeps that part's state when it leaves: a re-formed group puts
it at the same place, or it takes the state of its twin (the same place in another
replica).
"""

from __future__ import annotations

import gc
import math
import os
import re
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from datetime import timedelta

import numpy as np
import ray
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from actors import faults, rollout, zero_state
from actors.compress import GradSync
from actors.step import StepReport
from app.core import rewards
from app.core.checkpoint import (
    LIGHT,
    deserialize,
    light_weights,
    model_weights,
    serialize,
    tensor_hash,
    write_part,
)
from app.core.config import Config
from app.core.finetune import build_model, load_trained_state, trained_state
from app.core.flops import peak_flops
from app.core.model import GPT
from app.core.optim import make_optimizer, make_param_groups, make_scheduler, optimizer_class, optimizer_defaults
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
        if cfg.train.deterministic:  # cuBLAS needs its workspace fixed before CUDA starts
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.model = build_model(cfg).to(self.device)  # the same on every worker: seeded, or a base's (+ adapters)
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.sharded = False  # the optimizer is ZeRO-1's, holding this rank's shard of the state
        self.scheduler = make_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.train.precision == "fp16")
        self.manifest = manifest
        self.train_data: StreamingReader | None = None  # set by attach_cache
        self.eval_data = ShardReader(manifest, "eval", cfg.data.cache_shards)  # small, read directly
        self.ddp: DDP | GPT | None = None
        self.sync: GradSync | None = None  # the DDP communication hook; keeps top-k residuals across groups
        self.slowdown = 1.0  # > 1: an injected straggler (fault kinds "slow", "degrade", "noisy")
        self.failing: dict | None = None  # a fault of kind degrade, ecc or noisy: faults.tick acts on it each step
        self.poisoned = 0.0  # this step's loss is multiplied by it (fault kinds "nan", "spike")
        self._store: dist.TCPStore | None = None
        self._meeting: threading.Event | None = None  # set while join waits for its peers: `release` ends the wait
        self.rank, self.world = -1, 0
        self.applied = 0  # optimizer steps in this worker's state: which step it can resume from
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")  # one save at a time, off the step's path
        self._saving: Future | None = None
        self.peak_flops = peak_flops(self.device, cfg.train.precision)  # what MFU is measured against (None on CPU)
        self.params = self.model.num_params()  # the whole model's, whatever part of it this rank holds
        self.trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)  # less with LoRA
        self.replica = None  # with a layout, in a group: this rank's part (app/core/parallel.py Replica)
        self.held: dict | None = None  # with a layout, out of a group: the part's state, as layout_state.local_state
        self.task = rewards.load(cfg.ppo.reward) if cfg.ppo.reward else None  # a PPO run's prompts and scores

    def info(self) -> dict:
        node = ray.get_runtime_context().get_node_id()
        return {
            "pid": os.getpid(),
            "node": node,
            "params": self.params,
            "trainable": self.trainable,
            "applied": self.applied,
            "peak_flops": self.peak_flops,
        }

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
        self.train_data = StreamingReader(self.manifest, layout, cache, holder=ray.get_runtime_context().get_actor_id())
        if cursor is not None:
            self.train_data.get(take(layout, cursor, 1), cursor)

    def host_store(self) -> tuple[str, int]:
        """Serve the TCPStore the group meets at (rank 0 of a generation does this)."""
        timeout = timedelta(seconds=self.cfg.timeouts.join_s)
        self._store = dist.TCPStore(
            ray.util.get_node_ip_address(), 0, is_master=True, wait_for_workers=False, timeout=timeout
        )
        return self._store.host, self._store.port

    def join(self, rank: int, world: int, host: str, port: int, generation: int) -> int | None:
        """Enter the process group of `generation` (a fresh store prefix per membership). With a layout: the step
        whose state this rank holds for its place (-1: none, its twin's is needed)."""
        timeouts = self.cfg.timeouts
        store = (
            self._store
            if rank == 0
            else dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeouts.join_s))
        )
        store = dist.PrefixStore(f"gen{generation}/", store)
        self._meet(store, world)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeouts.collective_s),
        )
        self.rank, self.world = rank, world
        if self.cfg.parallel.ranks > 1:
            return self._lay_out()
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
        comm = self.cfg.comm
        self.sync = self.sync or GradSync(comm.compression, comm.topk_ratio, comm.powersgd_rank, comm.compress_start)
        self.sync.register(self.ddp)
        self.sync.regroup(rank, world, list(self.model.named_parameters()), self.applied)
        if comm.zero:
            self._shard_optimizer()

    def _lay_out(self) -> int:
        """Take this rank's part of the model: cut from the whole model this worker holds (a fresh one, or a
        checkpoint's), or rebuilt around the part it held in the last group when its place is the same.
        Elsewhere its state is of no use: -1, and the coordinator copies the twin's."""
        from app.core.layout_state import load_full, load_local
        from app.core.model import GPT
        from app.core.parallel import Replica, coords, make_mesh

        par = self.cfg.parallel
        mesh = make_mesh(self.world, par, self.device.type)
        at = coords(self.rank, par)
        if self.held is None:  # the whole model: its state goes with the cut
            whole = {"model": self.model.state_dict(), "optim": self._by_name(self.optimizer.state_dict())}
            self.replica = Replica(self.model, mesh, par, self.device)
            self._set_optimizer(make_optimizer(self.replica.model, self.cfg.optim))
            load_full(self.replica, self.optimizer, whole)
        else:  # rebuilt: the part's structure from the whole model, its values from what it held
            torch.manual_seed(self.cfg.train.seed)
            self.replica = Replica(GPT(self.cfg.model).to(self.device), mesh, par, self.device)
            self.optimizer = make_optimizer(self.replica.model, self.cfg.optim)
            self.scheduler = make_scheduler(self.optimizer, self.cfg.optim, self.cfg.train.steps)
            self.scheduler.load_state_dict(self.held["scheduler"])
            if tuple(self.held["at"]) == (at.stage, at.shard):
                load_local(self.replica, self.optimizer, self.held)
            else:
                self.applied = -1
        self.model, self.held = self.replica.model, None
        return self.applied

    def _by_name(self, optimizer_state: dict) -> dict:
        """A whole model's optimizer state by parameter name (layout_state's form)."""
        from app.core.layout_state import by_name, whole_groups

        return by_name(optimizer_state, whole_groups(self.cfg.model, self.cfg.optim))

    def _meet(self, store: dist.Store, world: int) -> None:
        """Wait until every rank of the generation has arrived, before the process group forms. torch's own
        rendezvous would wait for a peer that died on its way until timeouts.join_s, deaf to the coordinator's
        pings, and be taken for hung; this wait is a loop that `release` can end."""
        self._meeting = threading.Event()
        try:
            store.add("arrived", 1)
            deadline = time.monotonic() + self.cfg.timeouts.join_s
            while store.add("arrived", 0) < world:
                if self._meeting.is_set():
                    raise RuntimeError("released from the rendezvous: a peer of this group was lost on its way")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a peer did not reach the rendezvous within {self.cfg.timeouts.join_s:.0f} s")
                time.sleep(0.01)
        finally:
            self._meeting = None

    @ray.method(concurrency_group="control")
    def release(self) -> bool:
        """Answered beside the running call (actors/gather.py asks a worker that missed a ping): True if that call
        is a wait for peers in the rendezvous, which this ends; the worker is then free for the next group."""
        meeting = self._meeting
        if meeting is None:
            return False
        meeting.set()
        return True

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
        self._set_optimizer(sharded, sharded=True)

    def _unshard_optimizer(self, full: dict) -> None:
        """Back to a whole optimizer holding `full` (a consolidated state): needs no process group."""
        plain = make_optimizer(self.model, self.cfg.optim)
        plain.load_state_dict(full)
        self._set_optimizer(plain)

    def _set_optimizer(self, optimizer: torch.optim.Optimizer, sharded: bool = False) -> None:
        schedule = self.scheduler.state_dict()
        self.optimizer, self.sharded = optimizer, sharded
        self.scheduler = make_scheduler(optimizer, self.cfg.optim, self.cfg.train.steps)
        self.scheduler.load_state_dict(schedule)

    def _schedule_at(self, step: int) -> None:
        """The lr schedule at `step` of this run's train.steps (a resume may change them), including the
        last lr the next step reads: a loaded scheduler state holds the one of the run that saved it."""
        self.scheduler.last_epoch = step - 1
        with warnings.catch_warnings():  # "step() before optimizer.step()": intended, nothing is skipped
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()

    def optimizer_bytes(self) -> int:
        """Optimizer state this worker holds (ZeRO-1 keeps 1/world of it)."""
        local = self.optimizer.optim if self.sharded else self.optimizer
        local_tensors = (_local(t) for st in local.state.values() for t in st.values() if torch.is_tensor(t))
        return sum(t.numel() * t.element_size() for t in local_tensors)

    def train_step(
        self,
        step: int,
        ids: np.ndarray,
        global_batch: int,
        cursor: int,
        fault: dict | None = None,
        lr_scale: float = 1.0,
        max_norm: float = math.inf,
    ) -> StepReport:
        """This worker's share of one optimizer step: forward/backward with the gradient sync
        overlapping it, then clip and update.

        Each sample's loss weighs 1/global_batch however the batch is split, and
        DDP averages over the world, so the update equals the single-process
        update on the whole global batch for any split.
        """
        started = time.perf_counter()
        faults.apply(fault, self)
        faults.tick(self, step + 1)
        # a TP group's ranks draw alike: dropout on what they all hold (the residual stream) drops the same elements
        torch.manual_seed(step_seed(self.cfg.train.seed, step, self.rank // self.cfg.parallel.tp))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        rows, data = self.train_data.get(ids, cursor)
        if self.sync:
            self.sync.begin(step)
        computing = time.perf_counter()
        try:
            if self.replica is None:
                loss_sum = self._forward_backward(self._tensor(rows), global_batch / self.world)
                norm = None
            else:
                loss_sum, norm = self._replica_forward_backward(self._tensor(rows), len(ids) / global_batch)
            synced = time.perf_counter()
            grad_norm, lr = self._update(global_batch, lr_scale, max_norm, norm)
        except Exception as e:
            self._leave_broken_replica(e)
            self._abort_group()
            raise
        sync = self.sync.take_stats() if self.sync else {}
        # up to the last bucket: no waiting on peers. A replica's collectives are inside its schedule, not apart.
        compute_s = (sync.get("last_ready") or synced) - computing
        finite = math.isfinite(grad_norm) or self.scaler.is_enabled()  # fp16: the scaler skips overflowing steps itself
        if finite:
            self.applied = step + 1
            if self.sync:
                self.sync.commit(self.applied, sent=math.isfinite(grad_norm) and grad_norm <= max_norm)
        return StepReport(
            finite=finite,
            skipped=math.isfinite(grad_norm) and grad_norm > max_norm,
            loss=loss_sum,
            grad_norm=grad_norm,
            lr=lr,
            samples=len(ids),
            compute_s=compute_s,
            communication_s=synced - computing - compute_s,
            worker_s=time.perf_counter() - started,
            comm_bytes=sync.get("comm_bytes", 0),
            dense_bytes=sync.get("dense_bytes", 0),
            optimizer_bytes=self.optimizer_bytes(),
            data=data,
            saving=self._saving is not None and not self._saving.done(),
        )

    def ppo_step(
        self, step: int, indices: np.ndarray, beta: float, lr_scale: float, scorers: tuple, fault: dict | None = None
    ) -> StepReport:
        """This worker's share of a PPO step: rollouts of its prompts, then the updates (actors/rollout.py)."""
        faults.apply(fault, self)
        faults.tick(self, step + 1)
        seed = step_seed(self.cfg.train.seed, step, self.rank)
        try:
            report = rollout.ppo_step(self, indices, beta, lr_scale, scorers, seed)
        except Exception as e:
            self._leave_broken_replica(e)
            self._abort_group()
            raise
        if report.finite:
            self.applied = step + 1
        return report

    def ppo_evaluate(self, indices: np.ndarray, scorers: tuple, fault: dict | None = None) -> tuple[float, int]:
        faults.apply(fault, self)
        return rollout.evaluate(self, indices, scorers)

    def _forward_backward(self, rows: torch.Tensor, divisor: float) -> float:
        """Micro-batches accumulate; only the last one's backward syncs, bucket by bucket as it goes."""
        chunks = rows.split(self.cfg.train.micro_batch)
        loss_sum = 0.0
        for i, chunk in enumerate(chunks):
            sync = nullcontext() if i == len(chunks) - 1 or self.world == 1 else self.ddp.no_sync()
            with sync:
                forward_started = time.perf_counter()
                with self._autocast():
                    _, loss = self.ddp(chunk[:, :-1], chunk[:, 1:])
                if self.slowdown > 1:  # an injected straggler: backward costs about twice the forward
                    time.sleep((self.slowdown - 1) * 3 * (time.perf_counter() - forward_started))
                if self.poisoned:  # an injected NaN or spike (fault kinds "nan", "spike")
                    loss = loss * self.poisoned
                weighted = loss * len(chunk) / divisor
                self.scaler.scale(weighted).backward()
            loss_sum += weighted.item() / self.world
        self.poisoned = 0.0
        return loss_sum

    def _replica_forward_backward(self, rows: torch.Tensor, weight: float) -> tuple[float, float]:
        """This rank's part of the replica's step, then the gradients summed over the tied pair and the replicas
        and clipped by the whole model's norm. The step's loss is given by rank 0 alone (every rank knows it)."""
        if self.slowdown > 1 or self.poisoned:
            raise ValueError("fault kinds slow, nan and spike are not injected into a laid-out replica")
        with self._autocast():
            loss = self.replica.forward_backward(rows[:, :-1], rows[:, 1:], weight, self.cfg.train.micro_batch)
        grad_norm = self.replica.sync_and_clip(self.cfg.optim.grad_clip or float("inf"))
        return (loss if self.rank == 0 else 0.0), grad_norm

    def _update(
        self, global_batch: int, lr_scale: float, max_norm: float, grad_norm: float | None = None
    ) -> tuple[float, float]:
        """Clip and step. Every rank holds the same synchronised gradient, so every rank decides alike:
        no step on a non-finite gradient (the coordinator rolls the run back), and an outlier's step
        (norm above `max_norm`, the guard's limit) is skipped while the schedule goes on."""
        if grad_norm is None:  # a replica clipped already, over its ranks
            self.scaler.unscale_(self.optimizer)
            clip = self.cfg.optim.grad_clip or float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip).item()
        if not math.isfinite(grad_norm) and not self.scaler.is_enabled():
            return grad_norm, float("nan")
        if math.isfinite(grad_norm) and grad_norm > max_norm:  # fp16 overflow (inf) is the scaler's to skip
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.update()
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            return grad_norm, lr
        # The linear scaling rule (train.batch_scaling=linear): lr grows with the batch. 1 at constant batch.
        # lr_scale: halved by each rollback after a non-finite gradient.
        scale = global_batch / self.cfg.train.global_batch * lr_scale
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr * scale
        self.scaler.step(self.optimizer)
        self.scaler.update()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        return grad_norm, lr

    # -- parameter-server mode (actors/ps_mode.py) -------------------------------------

    def ps_attach(self, shards: list, names: list[list[str]], index: int) -> None:
        """Work against parameter shards, outside any process group: `index` names this worker to them."""
        self.ps = list(zip(shards, names))
        self.ddp, self.rank, self.world = self.model, index, 1
        self.versions = [0] * len(shards)

    def ps_pull(self, computing: bool = True) -> None:
        """The shards' current parameters into this replica: to compute a gradient on (the shards then
        count this worker as computing on that version), or to evaluate."""
        pulled = ray.get([shard.pull.remote(self.rank) if computing else shard.read.remote() for shard, _ in self.ps])
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for i, (version, tensors) in enumerate(pulled):
                self.versions[i] = version
                for name, tensor in tensors.items():
                    params[name].copy_(tensor)

    def ps_step(self, step: int, ids: np.ndarray, cursor: int, fault: dict | None = None) -> dict:
        """Pull, compute the gradient of `ids`, push it; return once an update holds it."""
        started = time.perf_counter()
        faults.apply(fault, self)
        faults.tick(self, step + 1)
        torch.manual_seed(step_seed(self.cfg.train.seed, step, self.rank))
        self.ps_pull()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        rows, data = self.train_data.get(ids, cursor)
        computing = time.perf_counter()
        loss_sum = self._forward_backward(self._tensor(rows), 1.0)  # gradient of the sum of per-sample losses
        compute_s = time.perf_counter() - computing
        grads = {n: p.grad for n, p in self.model.named_parameters()}
        grad_norm = self._clip_sum(grads, len(ids))
        pushes = [
            shard.push.remote(self.rank, version, {n: grads[n] for n in names}, len(ids))
            for (shard, names), version in zip(self.ps, self.versions)
        ]
        applied = ray.get(pushes)
        lr = applied[0]["lr"]
        return {
            "loss": loss_sum / len(ids),
            "grad_norm": grad_norm,
            "lr": lr,
            "samples": len(ids),
            "compute_s": compute_s,
            "worker_s": time.perf_counter() - started,
            "staleness": max(a["staleness"] for a in applied),
            "version": max(a["version"] for a in applied),
            "data": data,
        }

    def _clip_sum(self, grads: dict, samples: int) -> float:
        """Clip this worker's mean gradient to optim.grad_clip (each push is clipped on its own; the norm is
        returned)."""
        norm = (
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()
            / samples
        )
        clip = self.cfg.optim.grad_clip
        if clip and norm > clip:
            for g in grads.values():
                g.mul_(clip / norm)
        return norm

    def ps_export(self) -> tuple[dict, dict]:
        """Parameters and Adam moments by parameter name, to fill the shards."""
        names = self._optimizer_order()
        state = self.optimizer.state_dict()["state"]
        params = {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}
        return params, {names[i]: _snapshot(st) for i, st in state.items()}

    def ps_state(self, params: dict, moments: dict, step: int) -> None:
        """Take the shards' parameters and moments, to write a checkpoint in the format every mode loads."""
        full = self.optimizer.state_dict()
        order = {n: i for i, n in enumerate(self._optimizer_order())}
        full["state"] = {order[n]: m for n, m in moments.items()}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(params[name])
        self.optimizer.load_state_dict(full)
        self._schedule_at(step)

    def _optimizer_order(self) -> list[str]:
        """Parameter names in the optimizer's index order (its param groups, one after the other)."""
        name = {id(p): n for n, p in self.model.named_parameters()}
        return [name[id(p)] for g in make_param_groups(self.model, self.cfg.optim) for p in g["params"]]

    @torch.no_grad()
    def evaluate(self, ids: np.ndarray, fault: dict | None = None) -> tuple[float, int]:
        """Sum of per-sample mean losses over `ids` (held-out split), and their count."""
        faults.apply(fault, self)
        self.model.eval()
        if self.replica is not None:  # every rank of the replica runs it; rank 0 of the replica answers
            rows = self._tensor(self.eval_data.get(ids))
            with self._autocast():
                mean = self.replica.evaluate(rows[:, :-1], rows[:, 1:], self.cfg.train.micro_batch)
            first = self.replica.at.stage == 0 and self.replica.at.shard == 0
            return (mean * len(ids), len(ids)) if first else (0.0, 0)
        total = 0.0
        for chunk in self._tensor(self.eval_data.get(ids)).split(self.cfg.train.micro_batch):
            with self._autocast():
                _, loss = self.model(chunk[:, :-1], chunk[:, 1:])
            total += loss.item() * len(chunk)
        return total, len(ids)

    def state(self) -> bytes | None:
        """Model, optimizer, scheduler and scaler state, serialised for a checkpoint or a peer.

        With ZeRO-1 every member must call this together (the shards are gathered to rank 0);
        only rank 0 returns the state, the others None. With a layout, this rank's part, for its twin."""
        if self.replica is not None:
            from app.core.layout_state import local_state

            part = local_state(self.replica, self.optimizer)
            return serialize(part | self._schedule_state())
        sharded = self.sharded
        if sharded:
            self.optimizer.consolidate_state_dict(to=0)
            if self.rank != 0:
                return None
        data = serialize(
            {
                "model": {k: v.cpu() for k, v in trained_state(self.model).items()},
                "optimizer": _snapshot(self.optimizer.state_dict()),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
            }
        )
        if sharded:  # torch keeps the gathered shards on rank 0 until the next gathering: ZeRO's saving gone
            self.optimizer._all_state_dicts = []
        return data

    # -- checkpoints -----------------------------------------------------------------

    def checkpoint_begin(self, path: str, level: str, base_hashes: dict | None, background: bool = True) -> None:
        """Copy this rank's part of the state to CPU, then write it under `path`: in the background,
        so training goes on, unless told otherwise. Rank 0 writes the weights, scheduler and scaler;
        the optimizer state is rank 0's, or under ZeRO-1 each rank writes its own shard; with top-k every rank
        writes its residuals too (full saves)."""
        if self._saving is not None:  # a save the coordinator never collected (it went back past it): let it end
            wait([self._saving])
            self._saving = None
        lead = self.rank <= 0
        parts: dict = {}
        if self.replica is not None:
            self._stage_laid_out(parts, level)
            self._saving = self._writer.submit(self._write, path, level, parts, parts.pop("weights", None), base_hashes)
            if not background:
                wait([self._saving])
            return
        weights = {k: v.to("cpu", copy=True) for k, v in trained_state(self.model).items()} if lead else None
        if level == "full":
            if self.sharded:
                parts[f"optim-{max(self.rank, 0):03d}.pt"] = zero_state.local_part(self.optimizer)
                if lead:
                    parts["optim-groups.pt"] = zero_state.param_groups(self.optimizer)
            elif lead:
                parts["optim.pt"] = _snapshot(self.optimizer.state_dict())
            if lead:
                parts["extra.pt"] = _snapshot(
                    {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}
                )
            if self.world > 1 and self.sync and self.sync.mode == "topk":  # every rank, so a rank's file is its own
                named = list(self.model.named_parameters())
                parts[f"residual-{self.rank:03d}.pt"] = self.sync.saved(named, self.applied)
        self._saving = self._writer.submit(self._write, path, level, parts, weights, base_hashes)
        if not background:  # written when this returns; checkpoint_wait hands over the files or the error
            wait([self._saving])

    def _stage_laid_out(self, parts: dict, level: str) -> None:
        """The whole model's state gathered on rank 0 from the first replica's ranks, in the format every layout
        and a plain run read (model.pt, optim.pt by the whole model's parameter order): a checkpoint resumes in
        any layout. The other replicas hold the same state and take no part."""
        from app.core.layout_state import as_optimizer_state, full_state, whole_groups

        if self.replica.at.replica != 0:
            return
        full = full_state(self.replica, self.optimizer)
        if full is None:  # not the replica's first rank: its part is in `full` there
            return
        parts["weights"] = full["model"]
        if level == "full":
            groups = whole_groups(self.cfg.model, self.cfg.optim)
            parts["optim.pt"] = as_optimizer_state(full["optim"], self.optimizer.param_groups, groups)
            parts["extra.pt"] = _snapshot(self._schedule_state())

    def _schedule_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}

    def checkpoint_wait(self) -> dict | None:
        """The files written by the last save (name -> bytes, sha256) and the weights' hashes; raises its error."""
        if self._saving is None:
            return None
        try:
            return self._saving.result()
        finally:
            self._saving = None

    def _write(self, path: str, level: str, parts: dict, weights: dict | None, base_hashes: dict | None) -> dict:
        hashes = {k: tensor_hash(v) for k, v in weights.items()} if weights is not None else {}
        if weights is not None and level == "light":
            weights = light_weights(weights, hashes, base_hashes, self.cfg.checkpoint.light_dtype)
        if weights is not None:
            parts = {"model.pt": weights, **parts}
        return {"files": {name: write_part(path, name, obj) for name, obj in parts.items()}, "hashes": hashes}

    def load_state(self, data: bytes | dict, step: int) -> None:
        """Take a live peer's state (bytes) or a checkpoint's parts, which are at `step`. In a group
        with ZeRO-1, keep only this rank's shard of the optimizer state; outside one, all of it."""
        state = _assemble(data) if isinstance(data, dict) else deserialize(data)
        if self.replica is not None:
            return self._load_laid_out(state, step)
        self.applied = step
        if self.sync:  # top-k's unsent gradient: a checkpoint's goes with its state, this worker's may not
            self.sync.loaded(step, state.get("residuals"))
            if self.world > 1:  # in a group already (a resume, a rollback): this rank's now
                self.sync.regroup(self.rank, self.world, list(self.model.named_parameters()), step)
            elif self.world == 1:
                self.sync.drop()
        load_trained_state(self.model, state["model"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._unshard_optimizer(state["optimizer"])
        self._schedule_at(step)
        if self.cfg.comm.zero and self.world > 1:
            self._shard_optimizer()
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def _load_laid_out(self, state: dict, step: int) -> None:
        """A twin's part (a state with "at"), or a whole model's (a checkpoint's, from any layout): this rank's part."""
        from app.core.layout_state import load_full, load_local

        if "at" in state:
            load_local(self.replica, self.optimizer, state)
        else:
            whole = {"model": state["model"], "optim": self._by_name(state["optimizer"])}
            load_full(self.replica, self.optimizer, whole)
        self.scheduler.load_state_dict(state["scheduler"])
        self._schedule_at(step)
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.applied = step

    def flat_grad(self) -> torch.Tensor:
        """The synchronised gradient of the last step (for the gradient-equality check)."""
        return torch.cat([p.grad.detach().flatten().cpu() for p in self.model.parameters() if p.requires_grad])

    def _leave_broken_replica(self, error: Exception) -> None:
        """A rank whose replica lost a rank in its forward or backward exits. Its replica is out of the group
        anyway, and its state lives on in its twins; alive, it would hold the ranks of the other replicas in
        their gradient all-reduce until timeouts.collective_s: once DTensor is loaded, destroying a gloo group
        does not close its connections (measured on torch 2.13), and only the process's end does."""
        broken = type(error).__name__ == "ReplicaBroken"  # app/core/parallel.py's, loaded with the replica
        if broken and self.world > self.cfg.parallel.ranks:
            print(f"rank {self.rank}: {error}; exiting, so that the other replicas go on at once", flush=True)
            os._exit(1)

    def _abort_group(self) -> None:
        """Close this rank's connections after a failed collective. Of a dead rank's peers, only the
        ones connected to it fail at once; the others would wait out timeouts.collective_s for data
        that never comes (and be taken for hung). Closing here makes them fail at once too (not with a
        layout: see _leave_broken_replica)."""
        self.ddp = None  # it holds the group
        self._keep_part()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()

    def leave(self) -> None:
        """Leave the group. A ZeRO-1 shard is useless without its group: the optimizer state is
        then incomplete until `load_state` gives a whole one, and this worker no state source."""
        if self.sharded:
            self._set_optimizer(make_optimizer(self.model, self.cfg.optim))
            self.applied = -1
        self._keep_part()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.ddp, self.rank, self.world = None, -1, 0

    def _keep_part(self) -> None:
        """A laid-out rank leaving its group keeps its part's state, not the part: its mesh goes with the group."""
        if self.replica is None:
            return
        from app.core.layout_state import local_state

        self.held = local_state(self.replica, self.optimizer) | {"scheduler": self.scheduler.state_dict()}
        # the part is bound to this group's mesh, and `held` has its values: the next group builds it afresh
        self.replica = self.model = self.optimizer = self.scheduler = None

    def _tensor(self, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(rows.astype(np.int64)).to(self.device, non_blocking=True)

    def _autocast(self):
        if self.cfg.train.precision == "fp32":
            return nullcontext()
        dtype = torch.bfloat16 if self.cfg.train.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)


def spawn(cfg: Config, manifest: str, count: int, avoid: set[str] = frozenset()) -> list:
    """Start `count` worker actors, on none of the nodes in `avoid`; they build their models in parallel."""
    cluster = cfg.cluster
    # `release` has a thread of its own: it must answer while a join waits for its peers
    away = {"label_selector": {"ray.io/node-id": f"!in({','.join(sorted(avoid))})"}} if avoid else {}
    remote = ray.remote(concurrency_groups={"control": 1})(TrainWorker).options(
        num_cpus=cluster.cpus_per_worker, num_gpus=cluster.gpus_per_worker, max_restarts=0, **away
    )
    return [remote.remote(cfg.model_dump(), manifest) for _ in range(count)]


def _assemble(parts: dict[str, bytes]) -> dict:
    """A checkpoint's parts as one state: a light checkpoint's weights over its base's, ZeRO-1 shards merged."""
    model = model_weights(parts)
    if "optim.pt" in parts:
        optimizer = deserialize(parts["optim.pt"])
    else:
        shards = [deserialize(parts[n]) for n in sorted(parts) if re.fullmatch(r"optim-\d+\.pt", n)]
        optimizer = zero_state.merge(shards, deserialize(parts["optim-groups.pt"]))
    # top-k's residuals, one file per rank of the group that saved: a light checkpoint's come from its base, another
    # step's state, and are dropped
    ranks = {int(m[1]): n for n in parts if (m := re.fullmatch(r"residual-(\d+)\.pt", n))}
    if ranks and sorted(ranks) != list(range(len(ranks))):
        raise ValueError(f"the checkpoint's residual files are not one per rank 0..N-1: {sorted(ranks.values())}")
    carried = [deserialize(parts[ranks[r]]) for r in sorted(ranks)] if ranks and LIGHT not in parts else None
    return {"model": model, "optimizer": optimizer, **deserialize(parts["extra.pt"]), "residuals": carried}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor as this rank holds it: its shard of a DTensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(obj):
    """A copy of a state dict's tensors on CPU: training goes on changing the originals in place."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v) for v in obj]
    return obj
