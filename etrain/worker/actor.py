"""Training worker: one Ray actor, one rank of the process group. The actor is the worker's identity and its
envelope: warm-up, the data it reads, the process group it joins and leaves, a step's fault and seed, checkpoint
I/O. What a step does with the model is its engine's (engine.py): the one its mode names (etrain/core/modes.py).

A worker is built (torch imported, model and optimizer made, data opened)
before it joins a process group, so joining is cheap: the coordinator keeps
such workers warm in a pool (etrain/control/pool.py) and re-forms groups of live ones.

torch is imported where it is used, not by this module: Ray loads the actor's class in every process that receives
a handle to a worker, the coordinator first, which had spent ~2 s of its start (on cores the starting workers share)
and 180 MB of memory importing torch it never calls.
"""

from __future__ import annotations

import time

LOADING = time.time()  # when this process began loading the worker's code: its Ray start ends, its imports begin

import gc
import os
import re
import threading
from concurrent.futures import Future, wait
from datetime import timedelta
from typing import TYPE_CHECKING

import psutil
import ray

from etrain.core.checkpoint import (
    DCP,
    LIGHT,
    deserialize,
    light_weights,
    model_weights,
    read_part,
    serialize,
    tensor_hash,
    write_part,
)
from etrain.core.config import Config
from etrain.core.flops import peak_flops
from etrain.core.modes import mode_of
from etrain.data.order import Layout, take
from etrain.data.shards import ShardReader
from etrain.data.stream import StreamingReader
from etrain.worker.injection import Injected, apply, tick
from etrain.worker.one_team import on_thread
from etrain.worker.protocol import StepReport

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from etrain.worker.engine import Engine


def step_seed(seed: int, step: int, rank: int) -> int:
    """RNG state as a pure function of (seed, step number, rank): nothing to checkpoint, exact on resume. Step N
    draws what it drew when workers counted steps from 0, so a run resumed across that change stays exact."""
    return (seed * 1_000_003 + (step - 1) * 7_919 + rank) % 2**63


def make_engine(cfg: Config, device: torch.device) -> Engine:
    """The engine of this run's mode: one per run, fixed by its config (imported here: a layout's brings DTensor
    and the pipeline schedules, ~1 s)."""
    return mode_of(cfg).load_engine()(cfg, device)


class TrainWorker:
    def __init__(self, cfg_dict: dict, manifest: str):
        import torch

        from etrain.worker.engine import WorkerIO

        # wall-clock times of this worker's start (JOIN_PHASES): what a joiner's arrival cost, in its membership record
        self.marks = {"process": psutil.Process().create_time(), "loading": LOADING, "init": time.time()}
        self.cfg = cfg = Config.model_validate(cfg_dict)
        torch.set_num_threads(cfg.cluster.cpus_per_worker)
        self.device = torch.device("cuda" if cfg.cluster.gpus_per_worker > 0 else "cpu")
        if cfg.train.deterministic:  # cuBLAS needs its workspace fixed before CUDA starts
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        # built on a thread of its own: one left on this (the main) thread would slow every step (one_team.py)
        self.engine = on_thread("build", make_engine, cfg, self.device).result()
        self.manifest = manifest
        # the held-out split is small, read directly; the training split through the node's cache, once attached
        self.io = WorkerIO(ShardReader(manifest, "eval", cfg.data.cache_shards), Injected(), self.device)
        self._store: dist.TCPStore | None = None
        self._failed: int | None = None  # the step whose failure closed this rank's group, until it joins another
        self._meeting: threading.Event | None = None  # set while join waits for its peers: `release` ends the wait
        self._saving: Future | None = None
        self.peak_flops = peak_flops(self.device, cfg.train.precision)  # what MFU is measured against (None on CPU)
        self.marks["built"] = time.time()

    def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "params": self.engine.params,
            "trainable": self.engine.trainable,
            "applied": self.engine.applied,
            "peak_flops": self.peak_flops,
            "marks": self.marks,
        }

    def warm_up(self) -> None:
        self.engine.warm_up()
        self.marks["warmed"] = time.time()

    def attach_cache(self, cache, layout: Layout, cursor: int | None = None) -> None:
        """Read training shards through this node's cache (one ShardCache actor per node).

        With `cursor` (a pool worker waiting to join), open the shard read there now, so the
        first step after joining does not pay for the first call to the cache."""
        if self.io.train_data is not None:
            self.io.train_data.close()
        holder = ray.get_runtime_context().get_actor_id()
        self.io.train_data = StreamingReader(self.manifest, layout, cache, holder=holder)
        if cursor is not None:
            self.io.train_data.get(take(layout, cursor, 1), cursor)
        self.marks.setdefault("attached", time.time())

    # -- the process group -------------------------------------------------------------

    def host_store(self) -> tuple[str, int]:
        """Serve the TCPStore the group meets at (rank 0 of a generation does this)."""
        import torch.distributed as dist

        timeout = timedelta(seconds=self.cfg.timeouts.join_s)
        self._store = dist.TCPStore(
            ray.util.get_node_ip_address(), 0, is_master=True, wait_for_workers=False, timeout=timeout
        )
        return self._store.host, self._store.port

    def join(self, rank: int, world: int, host: str, port: int, generation: int) -> int | None:
        """Enter the process group of `generation` (a fresh store prefix per membership). With a layout: the step
        whose state this rank holds for its place (-1: none, its twin's is needed)."""
        import torch.distributed as dist

        timeouts = self.cfg.timeouts
        self.engine.generation = generation
        store = (
            self._store
            if rank == 0
            else dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeouts.join_s))
        )
        store = dist.PrefixStore(f"gen{generation}/", store)
        self._meet(store, world)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeouts.collective_s),
        )
        self._failed = None
        return self.engine.join(rank, world)

    def _meet(self, store: dist.Store, world: int) -> None:
        """Wait until every rank of the generation has arrived, before the process group forms. torch's own
        rendezvous would wait for a peer that died on its way until timeouts.join_s, deaf to the coordinator's
        pings, and be taken for hung; this wait is a loop that `release` can end."""
        self._meeting = threading.Event()
        try:
            store.add("arrived", 1)
            deadline = time.monotonic() + self.cfg.timeouts.join_s
            while store.add("arrived", 0) < world:
                if self._meeting.is_set():
                    raise RuntimeError("released from the rendezvous: a peer of this group was lost on its way")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a peer did not reach the rendezvous within {self.cfg.timeouts.join_s:.0f} s")
                time.sleep(0.01)
        finally:
            self._meeting = None

    @ray.method(concurrency_group="control")
    def stop_step(self, generation: int, step: int) -> None:
        """Answered beside the running call: a member of step `step` of group `generation` is lost (control/gather.py),
        so that step cannot commit. This rank ends it before its next micro-batch, instead of computing into an
        all-reduce that fails once it gets there: the recovery waits for that (a kill's detection was the survivors'
        compute). The group's redo of the step is another generation's: a late stop does not end it."""
        self.engine.stopped = (generation, step)

    @ray.method(concurrency_group="control")
    def release(self) -> bool:
        """Answered beside the running call (control/gather.py asks a worker that missed a ping): True if that call
        is a wait for peers in the rendezvous, which this ends; the worker is then free for the next group."""
        meeting = self._meeting
        if meeting is None:
            return False
        meeting.set()
        return True

    def leave(self) -> None:
        """Leave the group; the engine keeps what outlives it."""
        import torch.distributed as dist

        self.engine.leave(failed=False)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _abort_group(self) -> None:
        """Close this rank's connections after a failed collective. Of a dead rank's peers, only the
        ones connected to it fail at once; the others would wait out timeouts.collective_s for data
        that never comes (and be taken for hung). Closing here makes them fail at once too (not with a
        layout: see laid_out.py `_exit_if_others_go_on`)."""
        import torch.distributed as dist

        self.engine.leave(failed=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()

    # -- steps -------------------------------------------------------------------------

    def _begin(self, step: int, fault: dict | None) -> int:
        """Step `step` (its number, 1-based as in its records) starts: its fault injected, a slowly failing node's
        next symptom, and its seed."""
        apply(fault, self.io.injected, self.engine.sync)
        tick(self.io.injected, step)
        # a TP group's ranks draw alike: dropout on what they all hold (the residual stream) drops the same elements
        return step_seed(self.cfg.train.seed, step, self.engine.rank // self.cfg.parallel.tp)

    def step(self, step: int, work: dict, fault: dict | None = None) -> StepReport | dict:
        """This worker's share of step `step` in its mode, with the step's fault and seed: its engine's `step` on
        `work`, the arguments its mode's stepper sends (a training step's samples, a PPO step's prompts, a
        parameter-server push's)."""
        import torch

        if self._failed is not None:  # sent ahead of the step that failed (control/step.py): it cannot be committed
            raise RuntimeError(f"step {step} follows step {self._failed}, whose failure closed this rank's group")
        seed = self._begin(step, fault)
        torch.manual_seed(seed)
        try:
            report = self.engine.step(self.io, step, seed, **work)
        except Exception:
            self._failed = step
            self._abort_group()
            raise
        if isinstance(report, StepReport):
            report.saving = self._writing()
        return report

    def evaluate(self, work: dict, fault: dict | None = None) -> tuple[float, int]:
        """This worker's share of the held-out measure (a loss sum, or PPO's reward sum) and its count."""
        apply(fault, self.io.injected, self.engine.sync)
        return self.engine.held_out(self.io, **work)

    def call(self, verb: str, *args, **kwargs):
        """One of the engine's own verbs beyond a step (parameter-server mode's attach, pull, export, take_state)."""
        if verb not in self.engine.VERBS:
            raise ValueError(
                f"the {type(self.engine).__name__} engine has no verb {verb!r}; it has {self.engine.VERBS}"
            )
        return getattr(self.engine, verb)(*args, **kwargs)

    def flat_grad(self) -> torch.Tensor:
        return self.engine.flat_grad()

    def optimizer_bytes(self) -> int:
        return self.engine.optimizer_bytes()

    # -- state and checkpoints -----------------------------------------------------------

    def state(self) -> bytes | None:
        """Model, optimizer, scheduler and scaler state, serialised for a checkpoint or a peer.

        With ZeRO-1 every member must call this together (the shards are gathered to rank 0);
        only rank 0 returns the state, the others None. With a layout, this rank's part, for its twin."""
        state = self.engine.state()
        return serialize(state) if state is not None else None

    def load_state(self, data: bytes | dict, step: int) -> None:
        """Take a live peer's state (bytes) or a checkpoint's parts, which are at `step`."""
        self.engine.load(assemble(data) if isinstance(data, dict) else deserialize(data), step)

    def checkpoint_begin(self, path: str, level: str, base_hashes: dict | None, background: bool = True) -> bool:
        """Copy this rank's part of the state to CPU, then write it under `path`: in the background,
        so training goes on, unless told otherwise (engine.py `checkpoint_parts` says what each rank writes).
        Whether this rank writes anything: one that does not is no writer of this save (its loss does not fail it)."""
        if self._saving is not None:  # a save the coordinator never collected (it went back past it): let it end
            wait([self._saving])
            self._saving = None
        parts, weights = self.engine.checkpoint_parts(level, path)
        if not parts and weights is None:
            return False
        # one save at a time, off the step's path, on a thread that ends with it (one_team.py)
        self._saving = on_thread("checkpoint", self._write, path, level, parts, weights, base_hashes)
        if not background:  # written when this returns; checkpoint_wait hands over the files or the error
            wait([self._saving])
        return True

    @ray.method(concurrency_group="control")
    def checkpoint_wait(self) -> dict | None:
        """The files written by the last save (name -> bytes, sha256) and the weights' hashes; raises its error.
        Answered beside a running step (the coordinator asks once the writer said it is done, maybe while the next
        step, sent ahead, runs): a writer lost in that step does not fail a save it has written."""
        if self._saving is None:
            return None
        try:
            return self._saving.result()
        finally:
            self._saving = None

    def _write(self, path: str, level: str, parts: dict, weights: dict | None, base_hashes: dict | None) -> dict:
        hashes = {k: tensor_hash(v) for k, v in weights.items()} if weights is not None else {}
        if weights is not None and level == "light":
            weights = light_weights(weights, hashes, base_hashes, self.cfg.checkpoint.light_dtype)
        if weights is not None:
            parts = {"model.pt": weights, **parts}
        files = {}
        for name, obj in parts.items():
            files |= obj() if callable(obj) else {name: write_part(path, name, obj)}
        return {"files": files, "hashes": hashes}

    def _writing(self) -> bool:
        """A checkpoint part is still being written."""
        return self._saving is not None and not self._saving.done()


def spawn(cfg: Config, manifest: str, count: int, avoid: set[str] = frozenset()) -> list:
    """Start `count` worker actors, on none of the nodes in `avoid`; they build their models in parallel."""
    cluster = cfg.cluster
    # `release` has a thread of its own: it must answer while a join waits for its peers
    away = {"label_selector": {"ray.io/node-id": f"!in({','.join(sorted(avoid))})"}} if avoid else {}
    remote = ray.remote(concurrency_groups={"control": 1})(TrainWorker).options(
        num_cpus=cluster.cpus_per_worker, num_gpus=cluster.gpus_per_worker, max_restarts=0, **away
    )
    return [remote.remote(cfg.model_dump(), manifest) for _ in range(count)]


def assemble(parts: dict[str, bytes]) -> dict:
    """A checkpoint's parts as one state: a light checkpoint's weights over its base's, ZeRO-1 shards merged; a
    sharded run's as the URI of its DCP files, which each rank reads its part of (engine `load`)."""
    if DCP in parts:
        return {"dcp": parts[DCP].decode(), **read_part(parts, "extra.pt"), "residuals": None}
    model = model_weights(parts)
    if "optim.pt" in parts:
        optimizer = read_part(parts, "optim.pt")
    else:
        from etrain.worker import zero_state

        shards = [read_part(parts, n) for n in sorted(parts) if re.fullmatch(r"optim-\d+\.pt", n)]
        optimizer = zero_state.merge(shards, read_part(parts, "optim-groups.pt"))
    # top-k's residuals, one file per rank of the group that saved: a light checkpoint's come from its base, another
    # step's state, and are dropped
    ranks = {int(m[1]): n for n in parts if (m := re.fullmatch(r"residual-(\d+)\.pt", n))}
    if ranks and sorted(ranks) != list(range(len(ranks))):
        raise ValueError(f"the checkpoint's residual files are not one per rank 0..N-1: {sorted(ranks.values())}")
    carried = [read_part(parts, ranks[r]) for r in sorted(ranks)] if ranks and LIGHT not in parts else None
    # DiLoCo's inner optimizer states: rank 0's is optim.pt, each other rank's its own file
    inner = {int(m[1]): n for n in parts if (m := re.fullmatch(r"inner-(\d+)\.pt", n))}
    if inner and sorted(inner) != list(range(1, len(inner) + 1)):
        raise ValueError(
            f"the checkpoint's inner optimizer files are not one per rank 1..N-1: {sorted(inner)}; move this "
            "checkpoint's directory aside and resume: the run goes on from the newest checkpoint before it"
        )
    inners = [optimizer, *(read_part(parts, inner[r]) for r in sorted(inner))] if inner else None
    extra = read_part(parts, "extra.pt")
    return {"model": model, "optimizer": optimizer, **extra, "residuals": carried, "inner": inners}
