"""Where a run stands, as its coordinator tells it (`etrain status`, the Python API, status.json), and what a
request to resize it may ask for: the two driver- and user-facing questions a coordinator answers beside its loop."""

from __future__ import annotations

import os
import time

from etrain.core.comm_model import advise


def status_of(coordinator) -> dict:
    """The coordinator's answer to `status`: position, progress, members, pool, health, communication."""
    c = coordinator
    train, evaluated = (c.log.latest.get(k, {}) for k in ("train", "eval"))
    team, cfg = c.team, c.cfg
    par = cfg.parallel
    return {
        "run": c.run_dir.name,
        "run_dir": str(c.run_dir),
        "coordinator_pid": os.getpid(),
        "phase": c.phase.value,
        "failure": c.failure,
        "step": c.at.step,
        "total_steps": cfg.train.steps,
        "eta_s": c.log.eta(cfg.train.steps - c.at.step),
        "elapsed_s": time.time() - c.log.started_at,
        "loss": train.get("loss"),
        "eval_loss": evaluated.get("eval_loss"),
        "tokens_per_s": train.get("tokens_per_s"),
        "mfu": train.get("mfu"),
        "last_checkpoint": c.saver.last,
        "world_size": len(team.workers),
        # how each replica is laid out, and how many there are (members name each rank's replica, stage, shard)
        "layout": par.model_dump() | {"ranks": par.ranks, "replicas": par.replicas(len(team.workers))},
        "wanted": team.wanted,
        "autoscaling": team.autoscaling,
        "warm_pool_ready": team.pool.ready(),
        "warm_pool_starting": len(team.pool.idle) - team.pool.ready(),
        "recoveries": team.recoveries,
        "generation": team.generation,
        "draining_nodes": sorted(team.draining),
        "health": c.health.status(),
        "balanced": c.balancer.balanced,
        "comm": cfg.comm.mode,
        "mode": c.mode.name,
        "communication": _communication(c),
        "members": team.members(),
    }


def _communication(coordinator) -> str | None:
    """Whether communication bounds the run, and what another mode would save (etrain/core/comm_model.py)."""
    comm = coordinator.cfg.comm
    recent = list(coordinator.log.recent)
    advice = advise(recent, comm.topk_ratio, comm.diloco.inner_steps, comm.compression == "topk")
    return advice["advice"] if advice else None


def wanted_size(coordinator, workers: int | None, replicas: int | None) -> int:
    """The members a resize request asks for (`workers`, or `replicas` replicas of tp × pp × shard members);
    ValueError naming what the run cannot take."""
    cfg, par = coordinator.cfg, coordinator.cfg.parallel
    if replicas is not None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        workers = replicas * par.ranks
    if workers is None or workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if coordinator.mode.placed_state and (why := par.misfit(workers, cfg.train.global_batch, f"workers={workers}")):
        raise ValueError(
            f"{why}; ask for --replicas {max(1, par.replicas(workers))}, or --workers in multiples of {par.ranks}"
            if workers % par.ranks
            else why
        )
    if not coordinator.mode.resizable:
        raise ValueError(f"a run in mode {coordinator.mode.name} keeps its workers: it cannot be resized")
    coordinator.stepper.check_size(workers)
    if cfg.train.batch_scaling == "constant" and workers > cfg.train.global_batch:
        raise ValueError(
            f"workers must not exceed train.global_batch={cfg.train.global_batch} (every worker needs a "
            f"sample), got {workers}"
        )
    return workers
