"""Training-stability guards the coordinator applies between steps.

A gradient-norm outlier (above the running mean + k·σ of the accepted norms) is
usually a bad batch, not a lesson: its update is skipped and the batch's samples
go to the run's quarantine log. The statistics are a pure function of the norms
accepted so far and travel in checkpoints, so a resumed run makes the same
decisions. A step is judged by the norms of the steps up to the one before its
predecessor: the coordinator sends a step before its predecessor's norm is in
(etrain/control/step.py), and a step sent after it is judged alike.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from etrain.control.control import JobError
from etrain.core.config import TrainConfig


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


@dataclass
class Guards:
    """The stability guards of a run: the outlier guard's statistics, and the lr scale that each rollback
    after a non-finite gradient halves, a bounded number of times. All of it travels in checkpoints."""

    cfg: TrainConfig
    norms: NormWatch = field(default_factory=NormWatch)
    lr_scale: float = 1.0
    nan_rollbacks: int = 0
    judged: int = 0  # the last step whose norm the statistics took in (accepted or rejected)
    before: float = math.inf  # the limit before they took it in

    def limit(self, step: int) -> float:
        """The largest norm step `step` may have: from the norms of the steps before `step` − 1."""
        return self._limit() if self.judged < step - 1 else self.before

    def _limit(self) -> float:
        return self.norms.limit(self.cfg.outlier_sigmas, self.cfg.outlier_warmup)

    def accept(self, step: int, grad_norm: float) -> None:
        self.before, self.judged = self._limit(), step
        if math.isfinite(grad_norm):  # fp16: an overflow the scaler skipped says nothing
            self.norms.add(grad_norm)

    def reject(self, step: int) -> bool:
        """An outlier was skipped; True when the guard started over (a new regime)."""
        self.before, self.judged = self._limit(), step
        return self.norms.reject(self.cfg.outlier_patience)

    def diverged(self, step: int, resume_hint: str, suspects: str = "lower optim.lr or check the data") -> None:
        """A non-finite gradient at `step`: halve the lr for the rollback, or fail after train.max_nan_rollbacks
        saying what to look at (`suspects`)."""
        self.nan_rollbacks += 1
        if self.nan_rollbacks > self.cfg.max_nan_rollbacks:
            raise JobError(
                f"the gradient at step {step} is not finite after {self.cfg.max_nan_rollbacks} rollbacks "
                f"(train.max_nan_rollbacks), each halving the lr; {suspects}, then {resume_hint}"
            )
        self.lr_scale /= 2

    def state(self) -> dict:
        before = self.before if math.isfinite(self.before) else None  # JSON has no infinity
        return {"lr_scale": self.lr_scale, "norms": self.norms.state(), "limit_before": before, "judged": self.judged}

    def load(self, meta: dict, resume: bool) -> None:
        """A checkpoint's guards; a rollback keeps the lr it has halved since. A checkpoint written before the
        limits lagged a step has no `limit_before`: its next step is judged by all the norms it holds."""
        if resume:
            self.lr_scale = meta.get("lr_scale", 1.0)
        self.norms = NormWatch(**meta.get("norms", {}))
        before = meta.get("limit_before")
        self.before = math.inf if before is None else before
        self.judged = meta.get("judged", meta["step"] - 1) if "limit_before" in meta else meta["step"] - 1
