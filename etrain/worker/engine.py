"""One worker's training state (model, optimizer, schedule, scaler) and the update every mode shares.

A mode of training is an engine over this state: data_parallel.py (DDP, ZeRO-1, the gradient sync),
laid_out.py (one rank's part of a tensor/pipeline-parallel replica), diloco.py (local inner steps, an outer step
every few), rollout.py (PPO's rollouts and updates), param_server.py (shards on parameter servers). The actor
(actor.py) builds the one its mode names (etrain/core/modes.py) and calls only the methods below: a step, the
held-out measure, and a mode's own verbs (VERBS); a new mode is one more engine and one more spec.
"""

from __future__ import annotations

import math
import resource
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from etrain.core.config import Config
from etrain.core.finetune import build_model, load_trained_state, trained_state
from etrain.core.models.shared import LanguageModel, inputs_and_targets
from etrain.core.optim import as_optimizer_state, make_optimizer, make_scheduler, whole_groups
from etrain.worker.compress import GradSync
from etrain.worker.compute import train_on
from etrain.worker.injection import Injected
from etrain.worker.link import Link
from etrain.worker.protocol import StepReport


@dataclass
class WorkerIO:
    """What an engine's step reads besides its state: the run's data, and the faults injected into this worker."""

    eval_data: object  # the held-out split (a ShardReader)
    injected: Injected
    device: torch.device
    train_data: object | None = None  # the training split through the node's cache (a StreamingReader), once attached

    def tensor(self, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(rows.astype(np.int64)).to(self.device, non_blocking=True)


class StepStopped(RuntimeError):
    """A step ended by the coordinator (the actor's `stop_step`): a member of it was lost."""


class Engine:
    sync: GradSync | None = None  # the gradient sync's hook, where a kill_in_allreduce fault dies (data parallel)
    link: Link | None = None  # a simulated link the gradient path's collectives wait for (fault kind link)
    generation: int | None = None  # the group's, since this rank last joined one
    stepping: int | None = None  # the step running, or last run
    stopped: tuple[int, int] | None = None  # (generation, step) the coordinator ended: ended at its next micro-batch
    VERBS: tuple[str, ...] = ()  # a mode's own calls beside a step and the held-out measure (the actor's `call`)

    def __init__(self, cfg: Config, device: torch.device):
        self.cfg, self.device = cfg, device
        self.model = self.build_model()
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.scheduler = make_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
        self.params = self.model.num_params()  # the whole model's, whatever part of it this rank holds
        self.trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)  # less with LoRA
        self.rank, self.world = -1, 0
        self.applied = 0  # optimizer steps in this state: the step it can resume from (-1: none of use)

    def build_model(self) -> LanguageModel:
        """The model a worker starts with, the same on every worker: seeded, or a base's (+ adapters)."""
        return build_model(self.cfg).to(self.device)

    # -- the interface the actor calls -------------------------------------------------

    def warm_up(self) -> None:
        """One forward/backward on a dummy batch, so a pool worker's first real step runs at full speed (kernel
        selection, allocator, autograd threads); the state is untouched."""
        idx = torch.zeros((self.cfg.train.micro_batch, self.cfg.model.seq_len), dtype=torch.long, device=self.device)
        with self.autocast():
            _, loss = self.model(idx, idx)
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)

    def step(
        self,
        io: WorkerIO,
        n: int,
        seed: int,
        ids: np.ndarray,
        global_batch: int,
        cursor: int,
        lr_scale: float = 1.0,
        max_norm: float = math.inf,
        link: dict | None = None,
    ) -> StepReport:
        """This worker's share of optimizer step `n` on the samples `ids` (compute.py): the step of every mode the
        coordinator's state machine runs. `link`: a simulated link's fault (link.py), in force from its step on."""
        started = time.perf_counter()
        self.stepping = n
        self.link_to(link)
        rows, data = io.train_data.get(ids, cursor)
        done = train_on(self, io.tensor(rows), n, global_batch, lr_scale, max_norm, io.injected)
        grad_norm = done.grad_norm
        finite = math.isfinite(grad_norm) or self.scaler.is_enabled()  # fp16: the scaler skips overflows itself
        if finite:
            self.committed(n)
            if self.sync:
                self.sync.commit(self.applied, sent=math.isfinite(grad_norm) and grad_norm <= max_norm)
        return StepReport(
            finite=finite,
            skipped=math.isfinite(grad_norm) and grad_norm > max_norm,
            loss=done.loss,
            grad_norm=grad_norm,
            lr=done.lr,
            share=len(ids),
            compute_s=done.compute_s,
            communication_s=done.communication_s,
            update_s=done.update_s,
            worker_s=time.perf_counter() - started,
            comm_bytes=done.stats.get("comm_bytes", 0),
            dense_bytes=done.stats.get("dense_bytes", 0),
            optimizer_bytes=self.optimizer_bytes(),
            param_bytes=self.param_bytes(),
            peak_rss=peak_rss(),
            data=data,
        )

    @torch.no_grad()
    def held_out(self, io: WorkerIO, ids: np.ndarray) -> tuple[float, int]:
        """The held-out measure on this worker's share: the sum of per-sample mean losses over `ids`, and their
        count."""
        self.model.eval()
        return self.evaluate(io.tensor(io.eval_data.get(ids)))

    def join(self, rank: int, world: int) -> int | None:
        """The process group of (rank, world) has formed. With a layout: the step this rank holds its place's
        state of (-1: none, its twin's is needed)."""
        raise NotImplementedError

    def leave(self, failed: bool) -> None:
        """Before the process group goes: let go of what is bound to it (`failed`: a collective failed)."""
        raise NotImplementedError

    def forward_backward(self, rows: torch.Tensor, global_batch: int, injected: Injected) -> tuple[float, float | None]:
        """This rank's share of the step's loss, with the gradient synchronised; the clipped gradient's norm if the
        engine clipped already (None: `update` clips)."""
        raise NotImplementedError

    def link_to(self, fault: dict | None) -> None:
        """A simulated link (fault kind link) for this step's collectives, or none."""
        if fault is None:
            self.link = None
        elif self.link is None or not self.link.same(fault):
            self.link = Link(fault["gbps"], fault["latency_ms"])
        if self.sync:
            self.sync.link = self.link

    def outer_step(self, step: int) -> float:
        """After the update of `step`: DiLoCo's outer step where `step` ends a window (the seconds its all-reduce
        took); nothing in the other modes. Every rank calls it, whatever its update did: it may be a collective."""
        return 0.0

    def committed(self, step: int) -> None:
        """`step` succeeded on this rank: the state it can resume from, and give a peer, is the one after it."""
        self.applied = step

    def take_stats(self) -> dict:
        """Bytes handed to collectives since the last take, against what plain all-reduce would send, and when the
        last gradient bucket was ready (≈ the local backward's end)."""
        return self.sync.take_stats() if self.sync else {}

    def evaluate(self, rows: torch.Tensor) -> tuple[float, int]:
        """Sum of per-sample mean losses of `rows`, and their count (0, 0 where another rank answers)."""
        total = 0.0
        for chunk in rows.split(self.cfg.train.micro_batch):
            with self.autocast():
                _, loss = self.model(*inputs_and_targets(chunk))
            total += loss.item() * len(chunk)
        return total, len(rows)

    def state(self) -> dict | None:
        """The state a peer takes (`load`), or None where another rank gives it."""
        raise NotImplementedError

    def load(self, state: dict, step: int) -> None:
        """Take a peer's state or a checkpoint's (assembled: actor.assemble), which are at `step`."""
        raise NotImplementedError

    def checkpoint_parts(self, level: str, path: str) -> tuple[dict, dict | None]:
        """(file name -> object, the weights or None) this rank writes for a save of `level` under `path`, copied
        off the training state (the write happens in the background). An object may be a callable that waits for
        files written by other means (DCP's own thread) and returns them, name -> size and sha256."""
        raise NotImplementedError

    # -- the whole model's state, as one worker holds it (data parallel, parameter server) -----------------

    def weights(self) -> dict:
        """The trained weights, copied to CPU (a LoRA run's: its adapters)."""
        return {k: v.to("cpu", copy=True) for k, v in trained_state(self.model).items()}

    def whole_state(self) -> dict:
        return {"model": self.weights(), "optimizer": snapshot(self.optimizer.state_dict()), **self.schedule_state()}

    def load_whole(self, state: dict, step: int) -> None:
        """A whole model's state (a peer's, or a checkpoint's: a sharded run's DCP files read whole) into a new
        optimizer of this worker's, at `step`."""
        plain = make_optimizer(self.model, self.cfg.optim)
        if "dcp" in state:  # a sharded run's checkpoint: the whole state, gathered from its files
            from etrain.core.sharded_checkpoint import check_optimizer_state, whole_state  # torch DCP: only for one

            whole = whole_state(state["dcp"])
            names = whole_groups(self.cfg.model, self.cfg.optim)
            check_optimizer_state({n for group in names for n in group}, set(whole["optim"]), state["dcp"])
            state |= {
                "model": whole["model"],
                "optimizer": as_optimizer_state(whole["optim"], plain.param_groups, names),
            }
        load_trained_state(self.model, state["model"])
        plain.load_state_dict(state["optimizer"])
        self.set_optimizer(plain)
        self.load_schedule(state, step)
        self.applied = step

    def optimizer_bytes(self) -> int:
        """Optimizer state this worker holds."""
        held = self.held_optimizer()
        tensors = (_local(t) for st in held.state.values() for t in st.values() if torch.is_tensor(t))
        return sum(t.numel() * t.element_size() for t in tensors)

    def param_bytes(self) -> int:
        """Parameters this worker holds: its shards of a sharded model's."""
        return sum(_local(p).numel() * _local(p).element_size() for p in self.model.parameters())

    def held_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose state this rank holds (ZeRO-1's wraps a shard's)."""
        return self.optimizer

    # -- shared by the engines -----------------------------------------------------------

    def backward_chunks(self, module, rows: torch.Tensor, divisor: float, injected: Injected, quiet) -> list[float]:
        """Forward and backward of `rows` micro-batch by micro-batch, each sample's loss weighing 1/`divisor`, every
        micro-batch but the last inside `quiet()` (DDP's no_sync); the weighted losses, one per micro-batch."""
        chunks = rows.split(self.cfg.train.micro_batch)
        losses = []
        for i, chunk in enumerate(chunks):
            if self.stopped == (self.generation, self.stepping):
                raise StepStopped(f"step {self.stepping}: stopped, a member of it was lost")
            with nullcontext() if i == len(chunks) - 1 else quiet():
                forward_started = time.perf_counter()
                with self.autocast():
                    _, loss = module(*inputs_and_targets(chunk))
                if injected.slowdown > 1:  # an injected straggler: backward costs about twice the forward
                    time.sleep((injected.slowdown - 1) * 3 * (time.perf_counter() - forward_started))
                if injected.poisoned:  # an injected NaN or spike (fault kinds "nan", "spike")
                    loss = loss * injected.poisoned
                weighted = loss * len(chunk) / divisor
                self.scaler.scale(weighted).backward()
            losses.append(weighted.detach())
        injected.poisoned = 0.0
        return torch.stack(losses).tolist()  # one wait for the device, not one per micro-batch

    def update(
        self, global_batch: int, lr_scale: float, max_norm: float, grad_norm: float | None = None
    ) -> tuple[float, float]:
        """Clip and step. Every rank holds the same synchronised gradient, so every rank decides alike:
        no step on a non-finite gradient (the coordinator rolls the run back), and an outlier's step
        (norm above `max_norm`, the guard's limit) is skipped while the schedule goes on."""
        if grad_norm is None:
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

    def autocast(self):
        if self.cfg.train.precision == "fp32":
            return nullcontext()
        dtype = torch.bfloat16 if self.cfg.train.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def schedule_at(self, step: int) -> None:
        """The lr schedule at `step` of this run's train.steps (a resume may change them), including the
        last lr the next step reads: a loaded scheduler state holds the one of the run that saved it."""
        self.scheduler.last_epoch = step - 1
        with warnings.catch_warnings():  # "step() before optimizer.step()": intended, nothing is skipped
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()

    def schedule_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}

    def load_schedule(self, state: dict, step: int) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.schedule_at(step)
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """A new optimizer (sharded, unsharded, of a new part) under the same schedule."""
        schedule = self.scheduler.state_dict()
        self.optimizer = optimizer
        self.scheduler = make_scheduler(optimizer, self.cfg.optim, self.cfg.train.steps)
        self.scheduler.load_state_dict(schedule)

    def flat_grad(self) -> torch.Tensor:
        """The synchronised gradient of the last step (for the gradient-equality check)."""
        return torch.cat([p.grad.detach().flatten().cpu() for p in self.model.parameters() if p.requires_grad])


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor as this rank holds it: its shard of a DTensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (Linux reports KiB): what a start, a join, a save took."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def snapshot(obj):
    """A copy of a state dict's tensors on CPU: training goes on changing the originals in place."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    return obj
