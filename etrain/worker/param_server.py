"""Parameter-server mode's engine (the coordinator's side: etrain/control/ps_mode.py): outside any process group, a
worker pulls the shards' parameters, computes a gradient and pushes it; the shards (etrain/control/ps.py) apply it.
It holds the whole model, as a data-parallel worker of one does, and its checkpoints are one's: the shards' state is
loaded into it first (`take_state`), so a checkpoint of this mode resumes in any other and back."""

from __future__ import annotations

import time
from contextlib import nullcontext

import numpy as np
import ray
import torch

from etrain.core.optim import make_param_groups
from etrain.worker.engine import Engine, WorkerIO, snapshot
from etrain.worker.injection import Injected


class ParamServer(Engine):
    VERBS = ("attach", "pull", "export", "take_state")  # what etrain/control/ps_mode.py asks of a worker

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        self.shards: list = []  # (a ParamShard actor, the parameter names it holds)
        self.versions: list[int] = []  # each shard's version this worker's parameters were pulled at

    def attach(self, shards: list, names: list[list[str]], index: int) -> None:
        """Work against parameter shards: `index` names this worker to them."""
        self.shards = list(zip(shards, names))
        self.rank, self.world = index, 1
        self.versions = [0] * len(shards)

    def join(self, rank: int, world: int) -> None:
        raise RuntimeError("a parameter-server worker joins no process group: it works against its shards")

    def leave(self, failed: bool) -> None:
        """No group to leave: the shards hold the run's state."""

    def step(self, io: WorkerIO, n: int, seed: int, ids: np.ndarray, cursor: int) -> dict:
        """Pull, compute the gradient of `ids`, push it; return once an update holds it."""
        started = time.perf_counter()
        self.pull()  # the shards count this worker as computing from now on
        rows, data = io.train_data.get(ids, cursor)
        pushed = self.push_step(io.tensor(rows), io.injected)
        return pushed | {"worker_s": time.perf_counter() - started, "data": data}

    def forward_backward(self, rows: torch.Tensor, global_batch: int, injected: Injected) -> tuple[float, None]:
        """This worker's gradient of `rows` alone, each sample's loss weighing 1/`global_batch`: no sync."""
        losses = self.backward_chunks(self.model, rows, global_batch, injected, nullcontext)
        return sum(losses), None

    def state(self) -> dict:
        return self.whole_state()

    def load(self, state: dict, step: int) -> None:
        self.load_whole(state, step)

    def checkpoint_parts(self, level: str, path: str) -> tuple[dict, dict | None]:
        """A data-parallel worker of one's, written by worker 0 (the shards' state is taken into it first): the
        weights, and in a full save the optimizer and schedule."""
        if self.rank > 0:
            return {}, None
        if level != "full":
            return {}, self.weights()
        parts = {"optim.pt": snapshot(self.optimizer.state_dict()), "extra.pt": snapshot(self.schedule_state())}
        return parts, self.weights()

    def pull(self, computing: bool = True) -> None:
        """The shards' current parameters into this replica: to compute a gradient on (the shards then
        count this worker as computing on that version), or to evaluate."""
        shards = self.shards
        pulled = ray.get([shard.pull.remote(self.rank) if computing else shard.read.remote() for shard, _ in shards])
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for i, (version, tensors) in enumerate(pulled):
                self.versions[i] = version
                for name, tensor in tensors.items():
                    params[name].copy_(tensor)

    def push_step(self, rows: torch.Tensor, injected: Injected) -> dict:
        """Compute the gradient of `rows` on the parameters pulled last, push it; return once an update holds it."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        computing = time.perf_counter()
        loss_sum, _ = self.forward_backward(rows, 1, injected)  # gradient of the sum of per-sample losses
        compute_s = time.perf_counter() - computing
        grads = {n: p.grad for n, p in self.model.named_parameters()}
        grad_norm = self._clip_sum(grads, len(rows))
        pushes = [
            shard.push.remote(self.rank, version, {n: grads[n] for n in names}, len(rows))
            for (shard, names), version in zip(self.shards, self.versions)
        ]
        applied = ray.get(pushes)
        return {
            "loss": loss_sum / len(rows),
            "grad_norm": grad_norm,
            "lr": applied[0]["lr"],
            "samples": len(rows),
            "compute_s": compute_s,
            "staleness": max(a["staleness"] for a in applied),
            "version": max(a["version"] for a in applied),
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

    def export(self) -> tuple[dict, dict]:
        """Parameters and Adam moments by parameter name, to fill the shards."""
        names = self._optimizer_order()
        state = self.optimizer.state_dict()["state"]
        params = {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}
        return params, {names[i]: snapshot(st) for i, st in state.items()}

    def take_state(self, params: dict, moments: dict, step: int) -> None:
        """Take the shards' parameters and moments, to write a checkpoint in the format every mode loads."""
        full = self.optimizer.state_dict()
        order = {n: i for i, n in enumerate(self._optimizer_order())}
        full["state"] = {order[n]: m for n, m in moments.items()}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(params[name])
        self.optimizer.load_state_dict(full)
        self.schedule_at(step)

    def _optimizer_order(self) -> list[str]:
        """Parameter names in the optimizer's index order (its param groups, one after the other)."""
        name = {id(p): n for n, p in self.model.named_parameters()}
        return [name[id(p)] for g in make_param_groups(self.model, self.cfg.optim) for p in g["params"]]
