"""The training job, driver side: data, run directory, Ray, coordinator, progress.

Under `ray job submit` or with RAY_ADDRESS set it joins that cluster; otherwise
it starts a local Ray instance (token authentication on, Ray's default). A run
has one driver at a time: its lease (etrain/core/lease.py) is taken before anything starts.
"""

from __future__ import annotations

import importlib
import os
import tempfile
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

from etrain.control.control import JobError
from etrain.control.coordinator import Coordinator
from etrain.core.checkpoint import checkpoint_uri
from etrain.core.config import Config, ConfigError, override
from etrain.core.errors import why
from etrain.core.lease import acquire, release
from etrain.data.embedded import ensure_corpus
from etrain.data.shards import training_manifest
from etrain.driver import connect as cluster
from etrain.driver.connect import NAMESPACE
from etrain.driver.progress import Progress


def new_run_dir(cfg: Config) -> Path:
    name = cfg.run.name or datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = durable(Path(cfg.run.root).expanduser().resolve() / name, "run.root")
    if run_dir.exists():
        raise ConfigError(
            f"run directory {run_dir} already exists; pick another run.name, or continue it with --resume {run_dir}"
        )
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return run_dir


def durable(path: Path, key: str) -> Path:
    """`path`, refused when it lies in Ray's temporary directory: under `ray job submit --working-dir` a
    relative path lands in the unpacked package there, and the run is deleted with the session."""
    temp = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()).resolve() / "ray"
    if path.is_relative_to(temp) or "runtime_resources" in path.parts:
        raise ConfigError(
            f"{key} resolves to {path}, inside Ray's temporary directory ({temp}; under `ray job submit "
            f"--working-dir` a relative path lands in the unpacked package), which is deleted with the Ray "
            f"session: give it an absolute path on durable storage (e.g. --set run.root=/home/ubuntu/runs), "
            f"and on a multi-node cluster set checkpoint.uri to shared storage (s3://...)"
        )
    return path


def resolve_data(cfg: Config) -> str:
    """Manifest URI to train on, building the embedded corpus when none is given."""
    if cfg.data.source == "embedded":
        return ensure_corpus(cfg)
    check_data(cfg)
    return cfg.data.source


def check_data(cfg: Config) -> None:
    """A prepared corpus (data.source) that is there, readable, and packed for this model."""
    manifest = training_manifest(cfg.data.source)
    if manifest["seq_len"] != cfg.model.seq_len:
        raise ConfigError(
            f"data {cfg.data.source} is packed at seq_len {manifest['seq_len']}, but "
            f"model.seq_len={cfg.model.seq_len}; set model.seq_len={manifest['seq_len']}"
        )
    if manifest["vocab_size"] > cfg.model.vocab_size:
        tok = manifest.get("tokenizer")
        named = f"its tokenizer {tok['file']} (sha256 {tok['sha256'][:12]})" if isinstance(tok, dict) else "bytes"
        raise ConfigError(
            f"data {cfg.data.source} was tokenized with {named} into {manifest['vocab_size']} token ids, but "
            f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size={manifest['vocab_size']} (or more: a "
            "padded vocabulary), or prepare the data with the model's own tokenizer"
        )


def check_inputs(cfg: Config) -> Config:
    """What the user gave, checked before Ray starts and before a run directory is made, so that a refusal (exit 2)
    leaves nothing behind: the base and its LoRA targets, a drill's telemetry, the reward, the data, the cluster's
    address. The config comes back with its local paths absolute: the coordinator and the workers run elsewhere."""
    if cfg.checkpoint.uri and "://" not in cfg.checkpoint.uri:
        cfg = override(
            cfg, {"checkpoint.uri": str(durable(Path(cfg.checkpoint.uri).expanduser().resolve(), "checkpoint.uri"))}
        )
    if cfg.finetune.base is not None:  # a base that is gone or changed, or targets that name no layer of it
        from etrain.core.finetune import check_base

        check_base(cfg)
    if cfg.health.script is not None:  # a drill's telemetry: read by the coordinator, which runs on this node
        from etrain.core.health import read_script

        read_script(cfg.health.script, max(cfg.cluster.num_workers, cfg.cluster.max_workers or 0))
        cfg = override(cfg, {"health.script": str(Path(cfg.health.script).resolve())})
    if cfg.ppo.reward is not None:  # a reward that cannot be loaded, fails or is too slow; text the model cannot read
        from etrain.data import rewards

        responses = max(cfg.ppo.rollouts, cfg.ppo.eval_prompts)
        rewards.probe(rewards.load(cfg.ppo.reward, cfg.ppo.prompts), responses, cfg.reward_timeout_s())
        check_codec(cfg)
    if cfg.data.source != "embedded":
        check_data(cfg)
    address = cfg.cluster.address or (None if ray.is_initialized() else os.environ.get("RAY_ADDRESS"))
    if address and not address.startswith("ray://"):  # Ray Client's: its own connection, with its own timeout
        cluster.probe(address, cfg.timeouts.connect_s)
    return cfg


def check_codec(cfg: Config) -> None:
    """PPO's prompts and responses go through the run's tokenizer (etrain/data/tokenizer.py `for_run`): one that is
    missing, or has more tokens than the model's vocabulary, is refused before anything starts."""
    from etrain.data.tokenizer import for_run

    try:
        codec = for_run(cfg)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"PPO's prompts and responses go through the run's tokenizer: {e}") from None
    if codec.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the run's tokenizer ({codec.name}) has {codec.vocab_size} tokens, more than model.vocab_size="
            f"{cfg.model.vocab_size}: PPO's prompts would hold ids the model has no embedding for"
        )


def check_resume(run_dir: Path, cfg: Config) -> None:
    """A run that can go on: not an export (weights only, no run to continue), not one that has trained every step
    of cfg.train.steps already (its summary would be overwritten by a run of no steps)."""
    from etrain.core.checkpoint import newest_meta

    meta = newest_meta(checkpoint_uri(cfg, run_dir))
    if meta is not None and "exported_from" in meta:
        raise ConfigError(
            f"{run_dir} is an export of {meta['exported_from']} (weights only), not a run: it cannot be resumed; "
            f"fine-tune from it with `etrain finetune --from {run_dir}`"
        )
    if meta is not None and meta["step"] >= cfg.train.steps and _verifies(checkpoint_uri(cfg, run_dir), meta["step"]):
        raise ConfigError(
            f"run {run_dir} has trained all of its train.steps={cfg.train.steps} (its newest checkpoint is at step "
            f"{meta['step']}); to train it longer: etrain train --resume {run_dir} --set train.steps=N (N > "
            f"{meta['step']})"
        )


def _verifies(uri: str, step: int) -> bool:
    """Whether the checkpoint of `step` under `uri` is the newest that verifies. One that does not is no finished
    run: the resume goes back past it (the coordinator names it) and trains the steps again."""
    from etrain.core.checkpoint import CheckpointsCorrupt, load_latest

    try:
        newest = load_latest(uri)
    except CheckpointsCorrupt:
        return False
    return newest is not None and newest.meta["step"] >= step


def check_memory(cfg: Config) -> None:
    """Refuse a model that cannot fit a CPU worker on any node of the cluster (a GPU's memory is
    known only on the worker: it says so itself when it cannot start)."""
    if cfg.cluster.gpus_per_worker:
        return
    need = cfg.worker_memory()
    largest = max((n["Resources"].get("memory", 0) for n in ray.nodes() if n["Alive"]), default=0)
    if largest and need > largest:
        raise ConfigError(
            f"the model needs about {need / 2**30:,.1f} GiB per worker ({cfg.model.param_count():,} parameters: "
            f"weights, gradients, AdamW state, activations of train.micro_batch={cfg.train.micro_batch}), more than "
            f"the {largest / 2**30:,.1f} GiB for tasks on the largest node; lower model.d_model, model.n_layer "
            f"or train.micro_batch"
        )


def train(
    cfg: Config,
    run_dir: Path,
    resume: bool = False,
    started_at: float | None = None,
    progress: bool = True,
    on_eval: Callable[[dict], None] | None = None,
    log_every: float = 30.0,
    checked: bool = False,
    restart_if_corrupt: bool = False,
) -> dict:
    """Run (or resume) a job to its end; `on_eval` sees each evaluation record as it happens (a Tune trial reports
    them); `checked`: the caller has run `check_inputs` on `cfg` already (the CLI, before making the run directory);
    `restart_if_corrupt`: a resume whose every checkpoint fails verification trains from step 0 instead of stopping.
    The run's lease is taken first: a run another live driver is training is refused (RunBusy)."""
    started_at = started_at or time.time()
    run_dir = durable(Path(run_dir).resolve(), "the run directory")
    cfg = cfg if checked else check_inputs(cfg)
    lease = acquire(checkpoint_uri(cfg, run_dir), run_dir.name, cfg.timeouts.lease_s)
    try:
        shown = Progress(cfg.train.steps, progress, log_every)
        return _run(cfg, run_dir, resume, restart_if_corrupt, started_at, shown, on_eval, lease)
    finally:
        release(lease)


def _run(
    cfg: Config, run_dir: Path, resume: bool, restart: bool, started_at: float, progress: Progress, on_eval, lease
) -> dict:
    # The worker module brings torch (~3 s to import): load it while Ray starts.
    with ThreadPoolExecutor(1) as pool:
        worker_module = pool.submit(importlib.import_module, "etrain.worker")
        manifest = resolve_data(cfg)
        connect(cfg)
        connected_at = time.time()
        check_memory(cfg)
        workers = worker_module.result().spawn(cfg, manifest, cfg.cluster.num_workers)
    _wait_for_name(f"etrain:{run_dir.name}", cfg.timeouts.close_s)
    coordinator = ray.remote(Coordinator).options(
        name=f"etrain:{run_dir.name}", num_cpus=0, max_concurrency=4, scheduling_strategy=_beside_driver()
    )
    coordinator = coordinator.remote(cfg.model_dump(), str(run_dir), manifest, started_at, workers, lease, connected_at)
    try:
        done = coordinator.run.remote(resume, restart)
        _follow(coordinator, done, cfg, progress, on_eval)
        return ray.get(done)
    except ray.exceptions.RayActorError as e:
        if e.actor_init_failed:
            raise JobError(f"the job's coordinator could not start: {why(e)}") from None
        raise JobError(
            f"the job's coordinator died ({why(e)}): its process was killed or its node was lost; resume with `etrain "
            f"train --resume {run_dir}`"
        ) from None
    finally:
        ray.kill(coordinator)
        for w in workers:
            ray.kill(w)


def connect(cfg: Config, jobs: int = 1) -> None:
    """Join cluster.address (or RAY_ADDRESS, as under `ray job submit`), or start a local instance with logical
    CPUs for every worker and the warm pool of `jobs` jobs (trials), even on a 2-core laptop."""
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS") or None
    cpus = max(
        os.cpu_count() or 1, jobs * cfg.cluster.cpus_per_worker * (cfg.cluster.num_workers + cfg.cluster.warm_pool) + 1
    )
    cluster.connect(address, cfg.timeouts.connect_s, num_cpus=None if address else cpus)


def _resumed(e: dict) -> str:
    said = _skipped(e) + f"resumed at step {e['step']} from {e['path'] or e['reason']}"
    if e.get("reached_step", e["step"]) > e["step"]:
        said += f"; the run had reached step {e['reached_step']}: {e['reached_step'] - e['step']} steps are redone"
    if e.get("base"):
        said += (
            f"\nwarning: that is a light checkpoint (weights only): the optimizer, scheduler and scaler state "
            f"come from the full checkpoint {e['base']}, so the run leaves the uninterrupted trajectory"
        )
    return said


def _skipped(e: dict) -> str:
    """A warning line for each checkpoint a rewind passed over because it failed verification."""
    return "".join(f"warning: skipped checkpoint {s['path']}: {s['error']}\n" for s in e.get("skipped") or ())


def _wait_for_name(name: str, timeout_s: float) -> None:
    """A run resumed right after its driver was killed: Ray is still removing the old coordinator.
    One that outlives the wait is a live run of the same name, and two must not write one directory."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        if time.monotonic() > deadline:
            raise ConfigError(
                f"run {name.split(':', 1)[1]} is still running (its coordinator {name} is alive); "
                f"stop it first (`ray job stop`, or kill its driver) before resuming it"
            )
        time.sleep(0.5)


def _beside_driver():
    """The coordinator runs on the driver's node (the run directory is there). Inside a placement
    group (a Tune trial's), in its first bundle, so the workers it starts later stay in the group."""
    group = ray.util.get_current_placement_group()
    if group is not None:
        return PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
        )
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def _follow(coordinator, done, cfg: Config, progress: Progress, on_eval: Callable[[dict], None] | None = None) -> None:
    """Show the job's records as they come (etrain/driver/progress.py) until it ends; hand evaluations to `on_eval`."""
    try:
        try:  # its process starting (Ray's worker start, the imports) is not an answer it owes yet
            ray.get(coordinator.__ray_ready__.remote(), timeout=cfg.timeouts.join_s)
        except ray.exceptions.GetTimeoutError:
            raise JobError(
                f"the job's coordinator did not start within {cfg.timeouts.join_s:.0f} s (timeouts.join_s): the "
                "driver's node has no room for its process, or that process is hung"
            ) from None
        while True:
            finished, _ = ray.wait([done], timeout=0.5)
            try:
                phase, events = ray.get(coordinator.poll.remote(), timeout=cfg.timeouts.join_s)
            except ray.exceptions.GetTimeoutError:  # it answers polls between steps and during them: it is frozen
                raise JobError(
                    f"the job's coordinator has not answered for {cfg.timeouts.join_s:.0f} s (timeouts.join_s): its "
                    "process is hung or its node unreachable"
                ) from None
            progress.phase(phase)
            for e in events:
                _show(e, progress)
                if e["kind"] == "eval" and on_eval is not None:
                    on_eval(e)
            if finished:
                return
    finally:
        progress.close()


def _show(e: dict, progress: Progress) -> None:
    kind = e["kind"]
    if kind == "train":
        progress.step(e)
    elif kind in ("resume", "rollback", "outer"):
        progress.rewind(e["step"])
        if kind == "resume":
            progress.event(_resumed(e))
        elif kind == "rollback" and e.get("skipped"):
            progress.event(_skipped(e).rstrip("\n"))
        elif kind == "outer":
            progress.event(f"step {e['step']}: back to the last outer step ({e['reason']}); the window is redone")
    elif kind == "eval":
        progress.event(f"step {e['step']}: eval loss {e['eval_loss']:.4f}")
    elif kind == "warning":
        progress.event(f"step {e['step']}: warning: {e['text']}")
    elif kind == "checkpoint_failed":
        progress.event(f"step {e['step']}: warning: the checkpoint was not written ({e['error']}); training goes on")
    elif kind == "membership":
        phases = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in e["phases"].items())
        joined = e.get("joined")
        start = ", ".join(f"{k} {v:.2f} s" for k, v in joined.items()) if joined else ""
        progress.event(
            f"step {e['step']}: {e['reason']} {e['world_before']} -> {e['world_after']} workers in {e['total_s']:.2f} "
            f"s ({phases})" + (f"; the last joiner's start before it: {start}" if joined else "")
        )
