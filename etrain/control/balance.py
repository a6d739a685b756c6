"""Straggler-aware batch split: each worker's share of a step follows its measured speed.

Written by hand: no framework we know rebalances per-worker batch sizes (NVIDIA's
resiliency extension only detects stragglers). The global batch never changes,
only its split, and every sample's loss weighs 1/global_batch however the batch
is split (etrain/worker/data_parallel.py), so an update is the single-process update on the
same batch and the run stays deterministic up to float reduction order.

Speed is samples per second of a worker's own compute (forward and backward up
to its last gradient bucket), not of the step: a step's wall time is the
slowest worker's for everyone, and would hide who is slow.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from etrain.core.config import BalanceConfig


@dataclass
class Balancer:
    cfg: BalanceConfig
    speeds: dict[Hashable, float] = field(default_factory=dict)  # worker -> EMA of samples per compute-second
    balanced: bool = False  # shares follow speeds (a straggler was seen) rather than being equal
    streak: int = 0  # consecutive steps that called for the other mode

    def observe(self, workers: list[Hashable], samples: list[int], compute_s: list[float]) -> None:
        """A step's measured speeds (each worker's samples over its compute seconds), one call for all members."""
        ema, speeds = self.cfg.ema, self.speeds
        for worker, n, s in zip(workers, samples, compute_s):
            if s > 0 and n > 0:
                old = speeds.get(worker)
                speeds[worker] = n / s if old is None else (1 - ema) * old + ema * (n / s)

    def forget(self, keep: list[Hashable]) -> None:
        """Drop workers that left; a joiner starts at the mean speed until measured."""
        keep = set(keep)  # hashed: `in` a list of N members, for each of N, is O(N²)
        self.speeds = {w: s for w, s in self.speeds.items() if w in keep}

    def weights(self, workers: list[Hashable]) -> list[float]:
        """This step's shares. Equal while every worker is within `slow_below` of the mean speed;
        proportional to speed once one is not, until none is. A switch either way needs `patience`
        steps in a row that call for it: one noisy step (a page fault, a neighbour's burst) is not a straggler."""
        speeds = self._known(workers)
        mean = sum(speeds) / len(speeds)
        straggling = self.cfg.enabled and min(speeds) < self.cfg.slow_below * mean
        self.streak = self.streak + 1 if straggling != self.balanced else 0
        if self.streak >= self.cfg.patience:
            self.balanced, self.streak = straggling, 0
        return [s / mean for s in speeds] if self.balanced else [1.0] * len(workers)

    def state(self, workers: list[Hashable]) -> dict:
        """For a checkpoint: the mode, its streak, and the speeds by rank (actor handles do not outlive a run)."""
        return {"balanced": self.balanced, "streak": self.streak, "speeds": [self.speeds.get(w) for w in workers]}

    def load(self, state: dict | None, workers: list[Hashable]) -> None:
        """A resumed run splits its first steps as the checkpointed one would have; rank i's speed goes to worker i."""
        if not state:
            return
        self.balanced, self.streak = state["balanced"], state["streak"]
        self.speeds = {w: s for w, s in zip(workers, state["speeds"]) if s is not None}

    def _known(self, workers: list[Hashable]) -> list[float]:
        measured = [self.speeds[w] for w in workers if w in self.speeds]
        default = sum(measured) / len(measured) if measured else 1.0
        return [self.speeds.get(w, default) for w in workers]
