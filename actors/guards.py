"""Training-stability guards the coordinator applies between steps.

A gradient-norm outlier (above the running mean + k·σ of the accepted norms) is
usually a bad batch, not a lesson: its update is skipped and the batch's samples
go to the run's quarantine log. The statistics are a pure function of the norms
accepted so far and travel in checkpoints, so a resumed run makes the same
decisions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class NormWatch:
    """Running mean and variance of accepted gradient norms (Welford)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    streak: int = 0  # outliers in a row

    def add(self, norm: float) -> None:
        self.streak = 0
        self.n += 1
        delta = norm - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (norm - self.mean)

    def reject(self, patience: int) -> bool:
        """Count a skipped outlier. `patience` in a row are a new regime, not bad batches (the norms moved:
        compression started, the lr changed), and skipping on would only compound it: start over, judging
        again after the warm-up. True when it started over."""
        self.streak += 1
        if self.streak < patience:
            return False
        self.n, self.mean, self.m2, self.streak = 0, 0.0, 0.0, 0
        return True

    def limit(self, sigmas: float, warmup: int) -> float:
        """The largest norm accepted now: infinite until `warmup` norms are in, or with sigmas = 0."""
        if sigmas <= 0 or self.n < max(warmup, 2):
            return math.inf
        return self.mean + sigmas * math.sqrt(self.m2 / (self.n - 1))

    def state(self) -> dict:
        return asdict(self)
