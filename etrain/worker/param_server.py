"""Parameter-server mode (etrain/control/ps_mode.py): outside any process group, a worker pulls the shards' parameters,
computes a gradient and pushes it; the shards (etrain/control/ps.py) apply it. Its checkpoints are a data-parallel
worker's of one (the shards' state is loaded into it first: `take_state`)."""

from __future__ import annotations

import time

import ray
import torch

from etrain.core.optim import make_param_groups
from etrain.worker.data_parallel import DataParallel
from etrain.worker.engine import snapshot
from etrain.worker.injection import Injected


class ParamServer(DataParallel):
    def attach(self, shards: list, names: list[list[str]], index: int) -> None:
        """Work against parameter shards: `index` names this worker to them."""
        self.shards = list(zip(shards, names))
        self.ddp, self.rank, self.world = self.model, index, 1
        self.versions = [0] * len(shards)

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
