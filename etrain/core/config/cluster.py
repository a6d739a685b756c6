"""Where a run runs and how long it waits: its workers on the Ray cluster (cluster) and the bound on every wait
(timeouts)."""

from __future__ import annotations

from pydantic import Field, model_validator

from etrain.core.config.base import Section


class ClusterConfig(Section):
    num_workers: int = Field(2, ge=1)
    cpus_per_worker: int = Field(1, ge=1, description="also torch's thread count per worker")
    gpus_per_worker: float = Field(0, ge=0, description="> 0 trains on CUDA with NCCL")
    address: str | None = Field(None, description="Ray address; default RAY_ADDRESS or a new local instance")
    warm_pool: int = Field(1, ge=0, description="built workers kept outside the group for joins and replacements")
    max_workers: int | None = Field(
        None,
        ge=1,
        description="autoscale: grow onto free cluster resources up to this many workers; None: stay at num_workers "
        "(or what `etrain scale` asks)",
    )
    max_recoveries: int = Field(3, ge=0, description="lost-worker recoveries before the job fails")
    min_workers: int = Field(
        1, ge=1, description="a health drain never leaves fewer members than this (it waits for a replacement)"
    )
    relay_from: int = Field(
        64,
        ge=0,
        description="from this many members on, a step's calls go through one relay actor per node (the coordinator "
        "calls each node, not each member); 0: never",
    )


class TimeoutConfig(Section):
    """Every wait of a run is bounded by one of these, so a dead or hung peer surfaces as an error, never a hang.
    The first three nest, innermost first.

    - collective_s (60): one all-reduce or barrier (the torch process group's timeout)
    - step_s (180): one whole step on every worker, collectives included; an evaluation; a save's staging
    - join_s (300): workers started, group formed, state loaded; the driver's wait for the coordinator's answer
    - ping_s (2): a live worker's answer to a ping: one that does not answer is taken for hung
    - connect_s (30): reaching the Ray cluster (a dead address, a refused token)
    - lease_s (60): a run's lease not renewed for this long is stale: another driver may take the run over
    - close_s (30): an ending run's last writes and cleanup (the cursor, the node caches), and a resumed run's wait
      for the old coordinator to go
    """

    collective_s: float = Field(60, gt=0)
    step_s: float = Field(180, gt=0)
    join_s: float = Field(300, gt=0)
    ping_s: float = Field(2, gt=0)
    connect_s: float = Field(30, gt=0)
    lease_s: float = Field(60, ge=4)
    close_s: float = Field(30, gt=0)

    @model_validator(mode="after")
    def _nested(self) -> TimeoutConfig:
        if not self.collective_s < self.step_s < self.join_s:
            raise ValueError(
                f"timeouts must nest: collective_s < step_s < join_s, got {self.collective_s} / {self.step_s} / "
                f"{self.join_s}"
            )
        if self.ping_s >= self.step_s:
            raise ValueError(
                f"timeouts.ping_s={self.ping_s} must be below timeouts.step_s={self.step_s}: a ping is a moment, a "
                "step is not"
            )
        return self
