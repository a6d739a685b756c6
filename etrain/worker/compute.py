"""A worker's step on its rows, timed by part: forward and backward with the gradient sync overlapping it, clipping
and the update, DiLoCo's outer step at a window's end. An engine's `step` (engine.py) wraps it with the step's data
and report, the actor with its fault and seed; bench/gpu.py runs it alone on a GPU, without Ray, against plain
torch."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from etrain.worker.injection import Injected

if TYPE_CHECKING:
    from etrain.worker.engine import Engine


@dataclass
class Computed:
    loss: float  # this worker's share of the step's mean loss
    grad_norm: float
    lr: float
    compute_s: float  # up to the last gradient bucket: no waiting on peers
    communication_s: float  # the sync's time not hidden behind the backward pass, and the outer step's
    update_s: float  # clipping and the optimizer's step
    stats: dict  # the sync's: bytes sent, what they would have been dense


def train_on(
    engine: Engine,
    rows: torch.Tensor,
    step: int,
    global_batch: int,
    lr_scale: float,
    max_norm: float,
    injected: Injected,
) -> Computed:
    engine.model.train()
    engine.optimizer.zero_grad(set_to_none=True)
    if engine.sync:
        engine.sync.begin(step)
    computing = time.perf_counter()
    loss, norm = engine.forward_backward(rows, global_batch, injected)
    synced = time.perf_counter()
    grad_norm, lr = engine.update(global_batch, lr_scale, max_norm, norm)
    updated = time.perf_counter()
    outer_s = engine.outer_step(step)
    stats = engine.take_stats()
    # A replica's collectives are inside its schedule, not apart.
    compute_s = (stats.get("last_ready") or synced) - computing
    return Computed(loss, grad_norm, lr, compute_s, synced - computing - compute_s + outer_s, updated - synced, stats)
