"""DiLoCo (Douillard et al. 2023; TorchFT runs it fault-tolerantly): each worker trains on its own share of every
global batch with its own inner optimizer and no gradient sync, and every `comm.diloco.inner_steps` steps the
workers meet once. The outer step all-reduces the pseudo-gradient (the parameters of the last outer step minus the
worker's own now), each worker's weighted by the samples it took, and applies outer Nesterov SGD to the outer
parameters, which every worker then trains from again.

Written here because torch has no DiLoCo (TorchFT's needs its own manager and lighthouse). What outlives a window:
the outer parameters and momentum (the same on every worker) and each worker's inner optimizer state (its own),
which checkpoints hold (rank 0's as optim.pt, the others' as inner-NNN.pt) and a joiner takes from a live peer.
A worker's state of the last outer step is also kept aside: a change of members between outer steps sends the
run back to it (etrain/control/coordinator.py `_to_outer_step`), and each worker restores it as it rejoins.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from etrain.core.finetune import trained_state
from etrain.worker.data_parallel import DataParallel
from etrain.worker.engine import snapshot
from etrain.worker.injection import Injected


class Diloco(DataParallel):
    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.outer = [p.detach().clone() for p in self.trained]  # the parameters of the last outer step
        self.outer_optimizer = torch.optim.SGD(self.outer, **self._outer_defaults())
        self.kept = self._inner_state()  # this worker's inner optimizer and schedule at the last outer step
        self.samples = 0  # taken since the last outer step: the weight of this worker's pseudo-gradient
        self._carried: list[dict] | None = None  # a checkpoint's inner optimizer states, one per rank that saved
        self._before: tuple[list, dict] | None = None  # the outer state before an outer step not yet committed
        self._sent = 0

    def join(self, rank: int, world: int) -> None:
        """No DDP: nothing is synced until the outer step. Back to the state of the last outer step (a no-op at
        one): the members changed, and the window is redone from there."""
        self.rank, self.world, self.ddp = rank, world, self.model
        if self._carried is not None:
            self._take_carried()
        self._restore()

    def leave(self, failed: bool) -> None:
        self.ddp = None
        if not failed:
            self.rank, self.world = -1, 0

    def forward_backward(self, rows: torch.Tensor, global_batch: int, injected: Injected) -> tuple[float, None]:
        """This worker's own step on its share: each of its samples weighs 1/len(rows). Its loss is reported as its
        part of the global batch's mean, so the step's record holds the batch's mean as in every mode."""
        losses = self.backward_chunks(self.model, rows, len(rows), injected, nullcontext)
        self.samples += len(rows)
        return sum(losses) * len(rows) / global_batch, None

    def outer_step(self, step: int) -> float:
        """At a window's end: the samples-weighted mean pseudo-gradient over the group, then outer Nesterov SGD."""
        if not self.cfg.outer_step(step):
            return 0.0
        started = time.perf_counter()
        self._before = ([o.clone() for o in self.outer], snapshot(self.outer_optimizer.state_dict()))
        with torch.no_grad():
            flat = torch.cat([(o - p).flatten() for o, p in zip(self.outer, self.trained)])
            if self.world > 1:
                count = torch.tensor([self.samples], dtype=torch.float64, device=flat.device)
                dist.all_reduce(count)
                wire = flat.mul_(self.samples / count.item())
                wire = wire.bfloat16() if self.cfg.comm.diloco.bf16 else wire
                until = self.link.book(wire.nbytes, self.world) if self.link else 0.0
                dist.all_reduce(wire)
                if self.link:
                    self.link.wait(until)
                self._sent += wire.nbytes + count.nbytes
                flat = wire.to(flat.dtype)
            for o, g in zip(self.outer, flat.split([o.numel() for o in self.outer])):
                o.grad = g.view_as(o)
            self.outer_optimizer.step()
            for p, o in zip(self.trained, self.outer):
                p.copy_(o)
        self.samples = 0
        return time.perf_counter() - started

    def committed(self, step: int) -> None:
        """Only an outer step ends a state a peer can take: between two, each worker's parameters are its own."""
        if self.cfg.outer_step(step):
            self.applied, self.kept, self._before = step, self._inner_state(), None

    def take_stats(self) -> dict:
        sent, self._sent = self._sent, 0
        return {"comm_bytes": sent, "dense_bytes": sum(p.numel() * p.element_size() for p in self.trained)}

    def state(self) -> dict:
        """The state of the last outer step (a source of a migration may be between two): the outer parameters, this
        worker's inner optimizer then, the outer momentum."""
        with self._at_outer():
            model = {k: v.to("cpu", copy=True) for k, v in trained_state(self.model).items()}
        return {"model": model, **snapshot(self.kept), "outer": snapshot(self.outer_optimizer.state_dict())}

    def load(self, state: dict, step: int) -> None:
        """A peer's state or a checkpoint's (of any mode: without an outer momentum it starts at zero). Of a
        checkpoint's inner optimizer states, rank r takes rank r's (r mod their number at another size), once it
        has a rank."""
        super().load(state, step)
        with torch.no_grad():
            for o, p in zip(self.outer, self.trained):
                o.copy_(p)
        self.outer_optimizer = torch.optim.SGD(self.outer, **self._outer_defaults())
        if state.get("outer"):
            self.outer_optimizer.load_state_dict(state["outer"])
        self.samples, self.kept, self._carried, self._before = 0, self._inner_state(), state.get("inner"), None
        if self._carried is not None and self.world > 0:
            self._take_carried()

    def checkpoint_parts(self, level: str, path: str) -> tuple[dict, dict | None]:
        """At an outer step (checkpoints wait for one): rank 0 writes the weights, its inner optimizer as optim.pt,
        the schedule and the outer momentum; every other rank its inner optimizer as inner-NNN.pt (full saves)."""
        lead = self.rank <= 0
        weights = {k: v.to("cpu", copy=True) for k, v in trained_state(self.model).items()} if lead else None
        if level != "full":
            return {}, weights
        if not lead:
            return {f"inner-{self.rank:03d}.pt": snapshot(self.optimizer.state_dict())}, weights
        extra = {**self.schedule_state(), "outer": self.outer_optimizer.state_dict()}
        return {"optim.pt": snapshot(self.optimizer.state_dict()), "extra.pt": snapshot(extra)}, weights

    def _take_carried(self) -> None:
        carried, self._carried = self._carried, None
        self.optimizer.load_state_dict(carried[self.rank % len(carried)])
        self.kept = self._inner_state()

    def _restore(self) -> None:
        """Back to the last committed outer step: an outer step whose step then failed is undone first (this rank's
        all-reduce may have ended while a peer's did not)."""
        if self._before is not None:
            outer, momentum = self._before
            with torch.no_grad():
                for o, old in zip(self.outer, outer):
                    o.copy_(old)
            self.outer_optimizer.load_state_dict(momentum)
            self._before = None
        with torch.no_grad():
            for p, o in zip(self.trained, self.outer):
                p.copy_(o)
        self.optimizer.load_state_dict(self.kept["optimizer"])
        self.load_schedule(self.kept, self.applied)
        self.samples = 0

    def _inner_state(self) -> dict:
        return snapshot({"optimizer": self.optimizer.state_dict(), **self.schedule_state()})

    def _outer_defaults(self) -> dict:
        d = self.cfg.comm.diloco
        return {"lr": d.outer_lr, "momentum": d.outer_momentum, "nesterov": d.outer_momentum > 0}  # 0: plain SGD

    @contextmanager
    def _at_outer(self):
        """The model holding the outer parameters for a while (a peer's copy of the last outer step's state)."""
        with torch.no_grad():
            own = [p.detach().clone() for p in self.trained]
            for p, o in zip(self.trained, self.outer):
                p.copy_(o)
            try:
                yield
            finally:
                for p, mine in zip(self.trained, own):
                    p.copy_(mine)
