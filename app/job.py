"""The training job, driver side: data, run directory, Ray, coordinator, progress.

Under `ray job submit` or with RAY_ADDRESS set it joins that cluster; otherwise
it starts a local Ray instance (token authentication on, Ray's default).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import ray
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)
from tqdm import tqdm

from actors.coordinator import Coordinator
from app.api import NAMESPACE
from app.config import Config, ConfigError
from pipelines.embedded import ensure_corpus
from pipelines.shards import read_manifest


def new_run_dir(cfg: Config) -> Path:
    name = cfg.run.name or datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run.root).expanduser() / name
    if run_dir.exists():
        raise ConfigError(f"run directory {run_dir} already exists; pick another run.name, or continue it with --resume {run_dir}")
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return run_dir


def resolve_data(cfg: Config) -> str:
    """Manifest URI to train on, building the embedded corpus when none is given."""
    if cfg.data.source == "embedded":
        return ensure_corpus(cfg)
    manifest = read_manifest(cfg.data.source)
    if manifest["seq_len"] != cfg.model.seq_len:
        raise ConfigError(f"data {cfg.data.source} is packed at seq_len {manifest['seq_len']}, but model.seq_len={cfg.model.seq_len}; set model.seq_len={manifest['seq_len']}")
    if manifest["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"data {cfg.data.source} uses {manifest['vocab_size']} token ids, but model.vocab_size={cfg.model.vocab_size}")
    return cfg.data.source


def connect(cfg: Config, jobs: int = 1) -> None:
    if ray.is_initialized():
        return
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    # A local instance gets logical CPUs for every worker and the warm pool of `jobs` jobs (trials), even on a 2-core laptop.
    cpus = None if address else max(os.cpu_count() or 1, jobs * cfg.cluster.cpus_per_worker * (cfg.cluster.num_workers + cfg.cluster.warm_pool) + 1)
    # "local": a new instance even when a stale /tmp/ray/ray_current_cluster names a dead one.
    ray.init(address=address or "local", num_cpus=cpus, namespace=NAMESPACE, logging_level=logging.WARNING)


def train(cfg: Config, run_dir: Path, resume: bool = False, started_at: float | None = None, progress: bool = True,
          on_eval: Callable[[dict], None] | None = None) -> dict:
    """Run (or resume) a job to its end; `on_eval` sees each evaluation record as it happens (a Tune trial reports them)."""
    started_at = started_at or time.time()
    # The worker module brings torch (~3 s to import): load it while Ray starts.
    with ThreadPoolExecutor(1) as pool:
        worker_module = pool.submit(importlib.import_module, "actors.worker")
        manifest = resolve_data(cfg)
        connect(cfg)
        workers = worker_module.result().spawn(cfg, manifest, cfg.cluster.num_workers)
    _wait_for_name(f"etrain:{run_dir.name}")
    coordinator = ray.remote(Coordinator).options(name=f"etrain:{run_dir.name}", num_cpus=0, max_concurrency=4, scheduling_strategy=_beside_driver())
    coordinator = coordinator.remote(cfg.model_dump(), str(run_dir), manifest, started_at, workers)
    try:
        done = coordinator.run.remote(resume)
        _follow(coordinator, done, cfg, progress, on_eval)
        return ray.get(done)
    finally:
        ray.kill(coordinator)
        for w in workers:
            ray.kill(w)


def _resumed(e: dict) -> str:
    said = f"resumed at step {e['step']} from {e['path']}"
    if e.get("reached_step", e["step"]) > e["step"]:
        said += f"; the run had reached step {e['reached_step']}: {e['reached_step'] - e['step']} steps are redone"
    if e.get("base"):
        said += (f"\nwarning: that is a light checkpoint (weights only): the optimizer, scheduler and scaler state "
                 f"come from the full checkpoint {e['base']}, so the run leaves the uninterrupted trajectory")
    return said


def _wait_for_name(name: str, timeout_s: float = 30) -> None:
    """A run resumed right after its driver was killed: Ray is still removing the old coordinator.
    One that outlives the wait is a live run of the same name, and two must not write one directory."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        if time.monotonic() > deadline:
            raise ConfigError(f"run {name.split(':', 1)[1]} is still running (its coordinator {name} is alive); "
                              f"stop it first (`ray job stop`, or kill its driver) before resuming it")
        time.sleep(0.5)


def _beside_driver():
    """The coordinator runs on the driver's node (the run directory is there). Inside a placement
    group (a Tune trial's), in its first bundle, so the workers it starts later stay in the group."""
    group = ray.util.get_current_placement_group()
    if group is not None:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def _follow(coordinator, done, cfg: Config, progress: bool, on_eval: Callable[[dict], None] | None = None) -> None:
    # In a terminal the bar redraws in place; in a job log (ray job submit) a line every 30 s is enough.
    # Events go to stderr with the bar: stdout carries only the summary (scripts parse it).
    interactive = sys.stderr.isatty()
    bar = tqdm(total=cfg.train.steps, unit="step", desc="starting", disable=not progress, dynamic_ncols=True, mininterval=0.1 if interactive else 30)
    with bar:
        while True:
            finished, _ = ray.wait([done], timeout=0.5)
            phase, events = ray.get(coordinator.poll.remote())
            bar.set_description(phase)
            for e in events:
                if e["kind"] == "resume":
                    bar.n = e["step"]
                    bar.write(_resumed(e), file=sys.stderr)
                elif e["kind"] == "train" and e.get("loss") is not None:
                    bar.update(e["step"] - bar.n)
                    bar.set_postfix(loss=f"{e['loss']:.3f}", tok_s=f"{e['tokens_per_s']:.0f}", world=e["world_size"])
                elif e["kind"] == "eval":
                    bar.write(f"step {e['step']}: eval loss {e['eval_loss']:.4f}", file=sys.stderr)
                    if on_eval is not None:
                        on_eval(e)
                elif e["kind"] == "membership":
                    phases = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in e["phases"].items())
                    bar.write(f"step {e['step']}: {e['reason']} {e['world_before']} -> {e['world_after']} workers in {e['total_s']:.2f} s ({phases})",
                              file=sys.stderr)
            if finished:
                return
