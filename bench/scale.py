"""The control plane at scale, by simulation: the real coordinator driving 8 to 1,024 workers that do no work.

Nothing had measured the coordinator beyond 4 workers, and real runs have hundreds to thousands of ranks. Here the
real `Coordinator` (etrain/control/coordinator.py: its Team, Stepper, Saver, DataPlane, RunLog, HealthWatch, warm
pool) runs in this process and turns its own loop (observe, decide, act), one turn at a time, over fake workers:
objects with TrainWorker's public methods (etrain/worker/actor.py) whose `handle.method.remote(*args)` runs the
method at once and returns a real ObjectRef of its result, as a real actor's small answer comes (inline, into this
process's memory store: through a real actor that gives it back), so `ray.wait` and `ray.get` in the real code
run unchanged on a real local Ray. A fake equals and hashes as Ray's ActorHandle does (by an actor id, in Python),
so the coordinator's dicts and `in` tests cost what they cost with real handles. A fake that dies answers every
call with a ref of a real killed actor (RayActorError); a worker whose step fails answers with a RayTaskError.
The warm pool's `spawn`, `ray.kill`, the node caches, the node relays and the telemetry actors are redirected to
fakes while a session runs (`redirected`); the coordinator's code is not changed for it. From cluster.relay_from
members on (64), a step goes to each node's relay (etrain/control/relay.py), which calls its 8 members, and so
do a member change's calls (pings, the group's exit and forming, a failed step's stop): each such size also runs as
`direct-N`, the same coordinator calling every member itself (relay_from=0), the ratio beside.

A step takes no time on the workers (a set step time of zero): a step's wall time is the coordinator's. What the
fakes themselves spend (their answer's way through the echoing actor) is timed and subtracted, and their objects
are kept out of the garbage collector's traversals (they stand for other processes): each figure is the
coordinator's own time. Per size, one session (a fresh coordinator) runs:

1. step: 20 steps after 3 of warm-up, the coordinator's time per step (mean of the 20 turns of its loop);
2. recover: the middle rank killed in its step (the others' all-reduce fails with it, so the step is redone):
   the failed step's turn, the recovery (a ready pool worker takes its place, state from a live peer, re-form)
   and the redone step;
3. scale_out: a node of 8 ready pool workers joins (`request_scale(N + 8)`): the resize and its first step;
4. checkpoint: a full save with every one of the N workers writing a part (as ZeRO-1's optimizer shards are),
   synchronous: the staging, the N parts waited for, the commit marker listing them, retention;
5. memory (a session of its own, under tracemalloc): the coordinator's Python heap after the 23 steps, and its
   peak, less what the fake workers themselves hold.

Calibration: the same session with the fakes as real Ray actors (no torch; `--actors N`, 32 by default), through
real relay actors (relay_from=8), beside the in-process session of that size and config: the real actors' calls
cost Ray's submission and transfer, which the in-process figures leave out. And the real actors called each by
the coordinator (`actors_direct-N`): what the relay's extra hop costs where every process shares this machine's
cores.

Every variant runs once a round, --rounds rounds, interleaved (bench/rounds.py); each figure is the median over
the rounds with its spread. The slope of each curve on log-log axes says how it grows with N (1: linear, 2:
quadratic). Written: bench/results/scale.json and scale.png.

    python bench/scale.py [--sizes 8 64 256 1024] [--rounds 3] [--steps 20] [--actors 32] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import itertools
import json
import math
import os
import posixpath
import statistics
import sys
import tempfile
import time
import traceback
import tracemalloc
from pathlib import Path
from typing import NamedTuple

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rounds import interleaved, publish, summary  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "scale.json"
WARM = 3  # steps before the measured ones: the pool starts after the first
NODE = 8  # workers per (fake) node: a scale-out brings one node of them
SCENARIOS = ("step", "recover", "scale_out", "checkpoint")
STEP_BUDGET_MS = 20.0  # 2 % of a 1 s step
CHANGE_RATIO = 3.0  # a member change at the largest size, against the smallest
DIRECT = ("cluster.relay_from=0",)  # the `direct-N` variant: a call per member, no node relays (the peer)
CALIBRATED = (f"cluster.relay_from={NODE}",)  # the calibration's sessions: through real relays, a node's 8 each


# -- the fake workers ------------------------------------------------------------------


class Died(Exception):
    """Raised by a fake worker's method where the real process would have exited."""


class FakeWorker:
    """TrainWorker's public methods (etrain/worker/actor.py) without a model or data: a step reports its share and
    takes no time. A `kill` fault kills it; at a step where the run's config kills a rank, every other member's
    step fails too (its all-reduce lost a peer), once: the state a joiner takes from a survivor says so."""

    def __init__(self, cfg_dict: dict, manifest: str, node: str = "node-0000"):
        now = time.time()
        self.node, self.manifest, self.rank, self.applied = node, manifest, 0, 0
        self.doomed = {f["step"] for f in cfg_dict.get("faults", []) if f["kind"] == "kill"}
        self.failed: set[int] = set()  # doomed steps this worker's group already failed
        self.broken: int | None = None  # the step whose failure closed this worker's group, until it joins another
        self.marks = {"process": now, "loading": now, "init": now, "built": now}
        self.saved: dict | None = None

    def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "node": self.node,
            "params": 1_000_000,
            "trainable": 1_000_000,
            "applied": self.applied,
            "peak_flops": None,
            "marks": self.marks,
        }

    def warm_up(self) -> None:
        self.marks["warmed"] = time.time()

    def attach_cache(self, cache, layout, cursor: int | None = None) -> None:
        self.marks.setdefault("attached", time.time())

    def host_store(self) -> tuple[str, int]:
        return "127.0.0.1", 0

    def join(self, rank: int, world: int, host: str, port: int, generation: int) -> None:
        self.rank, self.broken = rank, None

    def release(self) -> bool:
        return False

    def leave(self) -> None:
        pass

    def stop_step(self, *step) -> None:  # nothing runs to stop
        pass

    def die(self) -> None:
        raise Died

    def step(self, step: int, work: dict, fault: dict | None = None):
        from etrain.worker.protocol import StepReport

        if fault and fault["kind"] == "kill":
            self.die()
        if self.broken is not None:  # sent ahead of the step that failed (TrainWorker.step)
            raise RuntimeError(f"step {step} follows step {self.broken}, whose failure closed this rank's group")
        if step in self.doomed and step not in self.failed:
            self.failed.add(step)
            self.broken = step
            raise RuntimeError(f"step {step}: a peer was lost in the all-reduce (simulated)")
        share, self.applied = len(work["ids"]), step
        data = {"hits": share, "misses": 0, "wait_s": 0.0}
        return StepReport(True, False, share / work["global_batch"], 1.0, 1e-3, share, share * 1e-3, 0.0,
                          share * 1e-3, 0, 0, 0, 0, 0, data)  # fmt: skip

    def evaluate(self, work: dict, fault: dict | None = None) -> tuple[float, int]:
        return 0.0, len(work["ids"])

    def state(self) -> dict:
        return {"applied": self.applied, "failed": sorted(self.failed)}

    def load_state(self, data: dict, step: int) -> None:
        self.applied, self.failed = step, self.failed | set(data["failed"])

    def checkpoint_begin(self, path: str, level: str, base_hashes: dict | None, background: bool = True) -> bool:
        """Every rank writes a part of its own (ZeRO-1's optimizer shards are so)."""
        name, body = f"part-{self.rank:05d}.bin", f"{self.rank} {self.applied}".encode()
        Path(path.removeprefix("file://"), name).write_bytes(body)
        self.saved = {"files": {name: {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}}, "hashes": {}}
        return True

    def checkpoint_wait(self) -> dict | None:
        saved, self.saved = self.saved, None
        return saved


class ActorWorker(FakeWorker):
    """The fake as a real Ray actor (the calibration): a kill is the process's exit."""

    def die(self) -> None:
        os._exit(1)


class FakeCache:
    """A node's ShardCache (etrain/data/cache.py) as the coordinator calls it."""

    def warm(self, cursor: int) -> None:
        pass

    def stats(self) -> dict:
        return {"fetched_bytes": 0, "fetched_shards": 0}

    def release_holder(self, holder: str) -> None:
        pass

    def close(self) -> None:
        pass


CACHE_ACTOR = ray.remote(num_cpus=0)(FakeCache)


class FakeRelay:
    """A node's relay (etrain/control/relay.py) in this process: its members' calls run here, every one of them
    (as the real relay submits them all), and the answer names the first that failed."""

    def __init__(self):
        self.members, self.cache, self.handles = [], None, {}

    def ready(self) -> bool:
        return True

    def step(self, n: int, generation: int, members: list | None, new: list, works: list, faults: list, cache=None):
        self._adopt(new)
        if members is not None:
            self.members = [self.handles[m] for m in members]
        self.cache = cache or self.cache
        out = self._answers([(h, "step", (n, work, fault)) for h, work, fault in zip(self.members, works, faults)])
        if self.cache is not None and out.failed is None:  # the node cache's counts, as the real relay adds them
            node, cache = self.cache
            out.results[0].data["cache"] = {"node": node, **cache.target.stats()}
        return out

    def call(self, method: str, members: list[str], new: list, args: list):
        self._adopt(new)
        return self._answers([(self.handles[m], method, a) for m, a in zip(members, args)])

    def ping(self, members: list[str], new: list, timeout: float) -> list[str]:
        from etrain.control.relay import ALIVE, DEAD

        self._adopt(new)
        said = []
        for m in members:
            h = self.handles[m]
            try:
                if h.dead:
                    raise Died
                h.target.info()
                said.append(ALIVE)
            except Died:
                h.dead = True
                said.append(DEAD)
        return said

    def tell(self, method: str, members: list[str], new: list, args: list) -> None:
        self._adopt(new)
        for m, a in zip(members, args):
            if not self.handles[m].dead:
                getattr(self.handles[m].target, method)(*a)

    def _adopt(self, new: list) -> None:
        from etrain.control.relay import key

        for h in new:
            self.handles[key(h)] = h

    def _answers(self, calls: list):
        from etrain.control.relay import Relayed

        out = Relayed([None] * len(calls), [False] * len(calls))
        for i, (h, method, args) in enumerate(calls):
            try:
                if h.dead:
                    raise ray.exceptions.RayActorError()
                out.results[i], out.back[i] = getattr(h.target, method)(*args), True
            except Died:
                h.dead, error = True, ray.exceptions.RayActorError()
            except ray.exceptions.RayActorError as e:
                error = e
            except Exception as e:
                error = ray.exceptions.RayTaskError(method, traceback.format_exc(), e)
            else:
                continue
            if out.failed is None:
                out.failed, out.error = i, error
        return out


class FakeTelemetry:
    """A node's telemetry actor (etrain/control/telemetry.py): nothing to report."""

    def read(self) -> list:
        return []


class Spent:
    """Seconds spent inside the fakes' calls (subtracted from the coordinator's wall time), and in the `ray.get` and
    `ray.wait` the coordinator calls (a part of its time, told apart)."""

    fakes = 0.0
    ray = 0.0


REAL_GET, REAL_WAIT = ray.get, ray.wait


def timed(call):
    def counted(*args, **kwargs):
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            Spent.ray += time.perf_counter() - started

    return counted


class Method:
    def __init__(self, handle: Handle, name: str):
        self.handle, self.name = handle, name

    def remote(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self._call(args, kwargs)
        finally:
            Spent.fakes += time.perf_counter() - started

    def _call(self, args: tuple, kwargs: dict):
        """The method's result as a ref, as Ray would give it: arguments that are refs resolved first."""
        h = self.handle
        if h.dead:
            return h.fleet.gone_ref()
        args = [REAL_GET(a) if isinstance(a, ray.ObjectRef) else a for a in args]
        try:
            return h.fleet.answer(getattr(h.target, self.name)(*args, **kwargs))
        except Died:
            h.dead = True
            return h.fleet.gone_ref()
        except Exception as e:
            return ray.put(ray.exceptions.RayTaskError(self.name, traceback.format_exc(), e))


class Handle:
    """A fake actor handle in this process. Equal and hashed by an actor id as ray.actor.ActorHandle is."""

    def __init__(self, target, fleet: Fleet):
        self.target, self.fleet, self.dead = target, fleet, False
        self._ray_actor_id = ray.ActorID.from_random()

    def __getattr__(self, name: str) -> Method:
        if name.startswith("_"):
            raise AttributeError(name)
        method = self.__dict__[name] = Method(self, name)
        return method

    @property
    def _actor_id(self):
        return self._ray_actor_id

    def __eq__(self, other):
        if not isinstance(other, Handle):
            return NotImplemented
        return self._ray_actor_id == other._ray_actor_id

    def __hash__(self):
        try:
            return self.__dict__["_ray_cached_hash"]
        except KeyError:
            h = self._ray_cached_hash = hash(self._ray_actor_id)
            return h

    def __reduce__(self):  # passed to a real actor (a cache handed to the calibration's workers): a name
        return str, (f"fake-{self._ray_actor_id.hex()}",)


@ray.remote(num_cpus=0)
class Gone:
    def call(self) -> None:
        pass


@ray.remote(num_cpus=0)
class Echo:
    """Gives back what it is given: a fake's answer reaches the coordinator as a real actor's small answer does,
    inline, into this process's memory store (a `ray.put` of it goes to the object store: getting 128 relays'
    answers from there took 17-23 ms here, against 11-13 ms inline)."""

    def call(self, value):
        return value


class Fleet:
    """Makes the workers: in this process (`actors=False`) or as real Ray actors; each call's workers on a node of
    their own, the first group's NODE to a node."""

    def __init__(self, actors: bool = False, inline: bool = True):
        self.actors, self.inline, self.nodes, self._gone, self._echo = actors, inline, itertools.count(), None, None

    def answer(self, value):
        """A ref of `value` as a real actor's answer: back (in the fake's time, subtracted), inline; without
        `inline`, through the object store (`ray.put`: cheaper to make, slower to read: for what a session does,
        not its times)."""
        if not self.inline:
            return ray.put(value)
        if self._echo is None:
            self._echo = Echo.remote()
        ref = self._echo.call.remote(value)
        REAL_WAIT([ref])
        return ref

    def gone_ref(self):
        """A ref whose get raises RayActorError: a call to a real actor that was killed."""
        if self._gone is None:
            self._gone = Gone.remote()
            REAL_GET(self._gone.call.remote())
            ray.kill(self._gone)
        return self._gone.call.remote()

    def spawn(self, cfg, manifest: str, count: int, avoid=frozenset()) -> list:
        """etrain.worker.spawn's signature: `count` workers, all on a new node."""
        node, cfg_dict = f"node-{next(self.nodes):04d}", cfg.model_dump()
        if self.actors:
            remote = ray.remote(ActorWorker).options(num_cpus=0, max_restarts=0)
            return [remote.remote(cfg_dict, manifest, node) for _ in range(count)]
        return [Handle(FakeWorker(cfg_dict, manifest, node), self) for _ in range(count)]

    def members(self, cfg, manifest: str, count: int) -> list:
        return [w for i in range(0, count, NODE) for w in self.spawn(cfg, manifest, min(NODE, count - i))]


@contextlib.contextmanager
def redirected(fleet: Fleet):
    """While a session runs: the warm pool spawns from `fleet`, `ray.kill` of a fake marks it dead, the node
    caches and telemetry actors the coordinator starts are fakes, and `ray.get` and `ray.wait` are timed."""
    import etrain.worker
    from etrain.control import telemetry
    from etrain.control.data_plane import DataPlane
    from etrain.control.relay import REMOTE, Relays

    def start_caches(self, nodes: set[str], cursor: int) -> None:
        for node in nodes - set(self.caches):  # real beside real actors: their relays ask them for counts
            self.caches[node] = CACHE_ACTOR.remote() if fleet.actors else Handle(FakeCache(), fleet)
            self.caches[node].warm.remote(cursor)

    def kill(actor, *args, **kwargs):
        if isinstance(actor, Handle):
            actor.dead = True
        else:
            real_kill(actor, *args, **kwargs)

    def start_relay(self, node: str):
        if fleet.actors:  # beside the real actors, wherever Ray puts it (their nodes are names, not Ray's nodes)
            self.actors[node] = relay = REMOTE.options(num_cpus=0).remote()
        else:
            self.actors[node] = relay = Handle(FakeRelay(), fleet)
        return relay

    real_kill, real_start, real_caches, real_relay = ray.kill, telemetry.start, DataPlane.start_caches, Relays._start
    etrain.worker.spawn, ray.kill, DataPlane.start_caches = fleet.spawn, kill, start_caches
    telemetry.start, Relays._start = (lambda node, sources: Handle(FakeTelemetry(), fleet)), start_relay
    ray.get, ray.wait = timed(REAL_GET), timed(REAL_WAIT)
    try:
        yield
    finally:
        del etrain.worker.spawn  # etrain.worker's own __getattr__ serves it again
        ray.kill, telemetry.start, DataPlane.start_caches = real_kill, real_start, real_caches
        Relays._start = real_relay
        ray.get, ray.wait = REAL_GET, REAL_WAIT


# -- a session: one coordinator over N workers ----------------------------------------------


def write_manifest(root: Path) -> str:
    """A manifest the data plane reads (16 shards of 32,768 samples, about 128 MB each at 2 KB a sample): no
    worker reads a shard."""
    from etrain.data.shards import FORMAT

    shards = [{"path": f"train-{i:05d}.parquet", "samples": 32768} for i in range(16)]
    splits = {"train": {"samples": 16 * 32768, "shards": shards}, "eval": {"samples": 64, "shards": []}}
    path = root / "manifest.json"
    path.write_text(json.dumps({"format": FORMAT, "splits": splits}))
    return str(path)


def overrides(n: int, root: Path, steps: int) -> list[str]:
    """The tiny preset at N workers, 4 samples each; a full save after the measured steps, synchronous (the whole
    commit path in one turn); rank N/2 killed in the step after it."""
    saved = WARM + steps
    return [
        f"run.root={root}",
        "train.steps=100000",
        "train.eval_every=0",
        f"train.global_batch={4 * n}",
        f"cluster.num_workers={n}",
        f"cluster.warm_pool={NODE}",
        f"checkpoint.every={saved}",
        "checkpoint.async_save=false",
        f"faults=[{{rank: {n // 2}, step: {saved + 1}, kind: kill}}]",
    ]


class Turn(NamedTuple):
    """A turn of the coordinator's loop: its state, the coordinator's own seconds in it (the fakes' time
    subtracted), and the part of them in `ray.get` and `ray.wait`."""

    state: str
    own: float
    ray: float


def total(turns: list[Turn]) -> Turn:
    return Turn("+".join(t.state for t in turns), sum(t.own for t in turns), sum(t.ray for t in turns))


class Session:
    """A real Coordinator over `n` workers from `fleet`, turned by hand (Coordinator.run's loop, one turn at a
    time, each timed)."""

    def __init__(self, n: int, fleet: Fleet, root: Path, steps: int, extra: tuple[str, ...] = ()):
        from etrain.control.control import State
        from etrain.control.coordinator import Coordinator
        from etrain.core.checkpoint import checkpoint_uri
        from etrain.core.config import load_config
        from etrain.core.lease import acquire

        self.n, self.steps, self.cfg = n, steps, load_config("tiny", [*overrides(n, root, steps), *extra])
        self.run_dir = root / f"run-{n}"
        self.run_dir.mkdir(parents=True)
        manifest = write_manifest(root)
        self.lease = acquire(checkpoint_uri(self.cfg, self.run_dir), self.run_dir.name, self.cfg.timeouts.lease_s)
        workers = fleet.members(self.cfg, manifest, n)
        # the fakes stand for other processes: out of the GC's traversals, which at 1,024 of them landed in the
        # coordinator's turns (its own objects, made from here on, are collected as they would be)
        gc.collect()
        gc.freeze()
        self.fakes_bytes = tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0
        self.c = Coordinator(self.cfg.model_dump(), str(self.run_dir), manifest, time.time(), workers, self.lease)
        self.handlers = {
            State.RUNNING: self.c._step,
            State.EVALUATING: self.c.evaluate,
            State.CHECKPOINTING: self.c.checkpoint,
            State.RESIZING: self.c._resize,
            State.RECOVERING: self.c._recover,
        }

    def start(self) -> None:
        """Coordinator.run's start: the status file, the data, the first group."""
        c = self.c
        c.restart_if_corrupt = False
        c.status_file.start()
        c.data.open()
        c._start(resume=False)

    def turn(self) -> Turn:
        """One turn of the loop: decide, then the decided state's handler; timed."""
        started, faked, in_ray = time.perf_counter(), Spent.fakes, Spent.ray
        state = self.c._decide()
        self.c.lost = self.handlers[state]()
        return Turn(state.value, time.perf_counter() - started - (Spent.fakes - faked), Spent.ray - in_ray)

    def until(self, done) -> list[Turn]:
        turns = []
        while not done():
            turns.append(self.turn())
            if len(turns) > 50:
                raise RuntimeError(f"no progress at {self.n} workers: {[t.state for t in turns]}")
        return turns

    def ready(self, count: int) -> None:
        """Untimed: the pool has `count` ready workers (Team.await_ready), and their nodes' relays are up. A real
        node's relay starts when the node is seen (Team.watch), long before a worker built there is ready; a fake
        node is not a Ray node, seen only in its workers' answers: its relay is started here, as watch would."""
        team = self.c.team
        team.await_ready(count, self.c.at)
        if team.relayed(team.target()):
            team.relays.prepare({team.nodes[w] for w in team.pool.preparing})
        REAL_GET([r.ready.remote() for r in team.relays.actors.values()])

    def close(self) -> None:
        from etrain.core.lease import release

        self.c.saver.finish()
        self.c.status_file.write()
        self.c._stop()
        release(self.lease)
        gc.unfreeze()


def run_session(n: int, fleet: Fleet, steps: int = 20, memory: bool = False, extra: tuple[str, ...] = ()) -> dict:
    """One session's figures (ms; bytes with `memory`: then only the steps are run) and what it did (`facts`)."""
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp, redirected(fleet):
        if memory:
            tracemalloc.start()
        s = Session(n, fleet, Path(tmp), steps, extra)
        try:
            s.start()
            s.until(lambda: s.c.at.step >= WARM)
            s.ready(NODE)
            turns = [s.turn() for _ in range(steps)]
            if memory:
                current, peak = tracemalloc.get_traced_memory()
                return {"memory_mb": (current - s.fakes_bytes) / 2**20, "peak_mb": (peak - s.fakes_bytes) / 2**20}
            steady = total(turns)
            out = {"step": Turn("step", steady.own / steps, steady.ray / steps), "checkpoint": checkpoint(s)}
            out |= {"recover": recover(s), "scale_out": scale_out(s)}
            figures = {k: 1000 * t.own for k, t in out.items()} | {f"{k}_ray": 1000 * t.ray for k, t in out.items()}
            return figures | {"facts": facts(s, [t.state for t in turns])}
        finally:
            s.close()
            if memory:
                tracemalloc.stop()


def checkpoint(s: Session) -> Turn:
    """The save due after the measured steps: its turn."""
    turns = s.until(lambda: s.c.saver.last is not None)
    assert [t.state for t in turns] == ["checkpointing"], turns
    return turns[0]


def recover(s: Session) -> Turn:
    """Rank N/2 killed in the next step: that step's turn, the recovery's, and the redone step's."""
    failed = s.c.at.step + 1
    turns = s.until(lambda: s.c.at.step == failed)
    assert [t.state for t in turns] == ["running", "recovering", "running"], turns
    return total(turns)


def scale_out(s: Session) -> Turn:
    """A node of 8 ready pool workers asked in: the resize's turn and its first step's (a step already sent when
    it was asked for runs first, and is not counted)."""
    s.ready(NODE)
    s.c.request_scale(workers=s.n + NODE)
    team = s.c.team
    turns = s.until(lambda: len(team.workers) == s.n + NODE and team._pending is None)
    states = [t.state for t in turns]
    assert states[states.index("resizing") :] == ["resizing", "running"], turns
    return total(turns[states.index("resizing") :])


def facts(s: Session, states: list[str]) -> dict:
    """What the session did, from its records: for tests/test_scale_bench.py."""
    from etrain.core.checkpoint import COMMIT
    from etrain.core.records import read_jsonl

    records = read_jsonl(s.run_dir / "metrics.jsonl")
    steps = [r for r in records if r["kind"] == "train"]
    commit = posixpath.join(s.c.saver.last["path"], COMMIT)

    def of(kind: str) -> list[dict]:
        return [r for r in records if r["kind"] == kind]

    return {
        "states": states,
        "steps": [r["step"] for r in steps],
        "cursor": s.c.at.cursor,
        "batches": sum(r["batch"] for r in steps),
        "last_cursor": steps[-1]["cursor"],
        "changes": [(r["reason"], r["world_before"], r["world_after"], r["lost"]) for r in of("membership")],
        "world": len(s.c.team.workers),
        "recoveries": s.c.team.recoveries,
        "checkpoints": [(r["step"], r["level"]) for r in of("checkpoint")],
        "parts": len(json.loads(Path(commit.removeprefix("file://")).read_text())["files"]),
        "relays": len(s.c.team.relays.actors),
    }


# -- the rounds, the fit, the report ---------------------------------------------------------


def relayed(n: int) -> bool:
    """Whether a session of `n` workers sends its steps through node relays by default (cluster.relay_from)."""
    from etrain.core.config.cluster import ClusterConfig

    return 0 < ClusterConfig.model_fields["relay_from"].default <= n


def measure(variant: str, args) -> dict:
    """One run of a variant: `fake-N` (in-process workers), `direct-N` (the same without node relays), `actors-N`
    (real Ray actors, relayed), `calib-N` (its in-process twin) and `actors_direct-N` (real actors, each called by the
    coordinator), `memory-N`."""
    kind, n = variant.rsplit("-", 1)
    extra = {"direct": DIRECT, "calib": CALIBRATED, "actors": CALIBRATED, "actors_direct": DIRECT}.get(kind, ())
    actors = kind.startswith("actors")
    result = run_session(int(n), Fleet(actors=actors), args.steps, memory=kind == "memory", extra=extra)
    result.pop("facts", None)
    return result


def line(variant: str, r: dict, began: float) -> str:
    if "memory_mb" in r:
        shown = f"memory {r['memory_mb']:7.2f} MB, peak {r['peak_mb']:7.2f} MB"
    else:
        shown = "  ".join(f"{k} {r[k]:7.1f} ms ({r[k + '_ray']:.0f} in Ray)" for k in SCENARIOS)
    return f"{variant:12s} {shown}   ({time.time() - began:5.0f} s so far)"


def slope(sizes: list[int], values: list[float]) -> float:
    """The exponent k of values ~ sizes^k: a least-squares line through the log-log points."""
    xs, ys = [math.log(n) for n in sizes], [math.log(max(v, 1e-9)) for v in values]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def analyse(medians: dict, sizes: list[int], actors: int) -> dict:
    """Figures per size, the slopes (over all sizes, and over the last two), ratios, targets, calibration."""
    figures = {n: {k: medians[f"fake-{n}"][k] for k in SCENARIOS + tuple(f"{s}_ray" for s in SCENARIOS)} for n in sizes}
    for n in sizes:
        figures[n] |= {k: medians[f"memory-{n}"][k] for k in ("memory_mb", "peak_mb")}
    keys = (*SCENARIOS, "memory_mb")
    med = {n: {k: v["median"] for k, v in f.items()} for n, f in figures.items()}
    if len(sizes) < 2:
        raise SystemExit("the slopes need two --sizes at least")
    slopes = {k: round(slope(sizes, [med[n][k] for n in sizes]), 3) for k in keys}
    last = {k: round(slope(sizes[-2:], [med[n][k] for n in sizes[-2:]]), 3) for k in keys}
    small, big = sizes[0], sizes[-1]
    ratios = {f"{k}_{big}_vs_{small}": med[big][k] / med[small][k] for k in keys}
    ratios[f"step_share_of_1s_at_{big}"] = med[big]["step"] / 1000
    targets = {
        f"step_ms_at_{big}": {"value": med[big]["step"], "limit": STEP_BUDGET_MS},
        f"recover_{big}_vs_{small}": {"value": ratios[f"recover_{big}_vs_{small}"], "limit": CHANGE_RATIO},
        f"scale_out_{big}_vs_{small}": {"value": ratios[f"scale_out_{big}_vs_{small}"], "limit": CHANGE_RATIO},
        # well short of N² (2), over all sizes and over the largest two (where a square term shows first)
        "largest_slope": {"value": max(*slopes.values(), *last.values()), "limit": 1.5},
    }
    for t in targets.values():
        t["met"] = t["value"] <= t["limit"]
    report = {"figures": figures, "slopes": slopes, "slopes_last_segment": last, "ratios": ratios, "targets": targets}
    report["relays"] = {  # ours against the same coordinator calling each member (a size relayed by default)
        n: {
            k: {"relayed": (a := med[n][k]), "direct": (b := medians[f"direct-{n}"][k]["median"]), "ratio": b / a}
            for k in SCENARIOS
        }
        for n in sizes
        if f"direct-{n}" in medians
    }
    if actors:
        real, fake = medians[f"actors-{actors}"], medians[f"calib-{actors}"]
        report["calibration"] = {
            k: {"actors": (a := real[k]["median"]), "in_process": (b := fake[k]["median"]), "ratio": a / b}
            for k in SCENARIOS
        } | {"workers": actors}
        direct = medians[f"actors_direct-{actors}"]
        report["relays_on_actors"] = {  # real actors on this machine: relayed against called each by the coordinator
            k: {"relayed": (a := real[k]["median"]), "direct": (b := direct[k]["median"]), "ratio": b / a}
            for k in SCENARIOS
        } | {"workers": actors}
    return report


def table(report: dict) -> str:
    """Per size: each scenario's median (ms), with the part of it in Ray's get and wait; the memory; the slopes."""
    rows = ["workers " + "".join(f"{k + ' ms (Ray)':>22s}" for k in SCENARIOS) + "   memory MB (peak)"]
    for n, f in report["figures"].items():
        m = {k: v["median"] for k, v in f.items()}
        cells = "".join(f"{m[k]:>14.1f} ({m[k + '_ray']:5.1f})" for k in SCENARIOS)
        rows.append(f"{n:7d} {cells}   {m['memory_mb']:.2f} ({m['peak_mb']:.2f})")
    for name, key in (("slope", "slopes"), ("last two", "slopes_last_segment")):
        rows.append(f"{name:8s}" + "  ".join(f"{k} {v:.2f}" for k, v in report[key].items()))
    for n, per in report["relays"].items():
        shown = "  ".join(f"{k} {v['direct']:.1f} / {v['relayed']:.1f} = {v['ratio']:.2f}x" for k, v in per.items())
        rows.append(f"at {n}, a call per member / node relays (ms): {shown}")
    if real := report.get("relays_on_actors"):
        per = {k: v for k, v in real.items() if k != "workers"}
        shown = "  ".join(f"{k} {v['direct']:.1f} / {v['relayed']:.1f} = {v['ratio']:.2f}x" for k, v in per.items())
        rows.append(f"{real['workers']} real actors, a call per member / node relays (ms): {shown}")
    return "\n".join(rows)


def label(report: dict, key: str, name: str = "") -> str:
    return f"{name or key}: slope {report['slopes'][key]:.2f}, {report['slopes_last_segment'][key]:.2f} at the top"


def plot(report: dict, path: Path) -> None:
    """Log-log: one line per scenario (ms), the memory (MB) beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    rows = sorted((int(n), f) for n, f in report["figures"].items())  # a report read back has its sizes as text
    sizes = [n for n, _ in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k in SCENARIOS:
        left.plot(sizes, [f[k]["median"] for _, f in rows], "o-", label=label(report, k))
    left.axhline(STEP_BUDGET_MS, color="grey", ls="--", lw=0.8, label="2 % of a 1 s step")
    right.plot(sizes, [f["memory_mb"]["median"] for _, f in rows], "o-", label=label(report, "memory_mb", "heap"))
    for ax, unit in ((left, "coordinator time, ms"), (right, "coordinator heap, MB")):
        ax.set(xscale="log", yscale="log", xlabel="workers", ylabel=unit)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.legend(fontsize=8)
    left.set_title("the control plane's time per scenario")
    right.set_title("the coordinator's memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024], help="workers per session")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each figure is their median")
    p.add_argument("--steps", type=int, default=20, help="measured steps per session")
    p.add_argument("--actors", type=int, default=32, help="the calibration's real Ray actors (0: none)")
    p.add_argument("--out", default=str(RESULTS), help="the JSON (the plot beside it, .png); '' writes nothing")
    args = p.parse_args()
    os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"  # the failed step's answers no one reads (its survivors')
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning")
    names = [f"{kind}-{n}" for n in args.sizes for kind in ("fake", "memory")]
    names += [f"direct-{n}" for n in args.sizes if relayed(n)]
    if args.actors:
        names += [f"actors-{args.actors}", f"calib-{args.actors}", f"actors_direct-{args.actors}"]
    began = time.time()
    runs = interleaved(args.rounds, names, lambda v: measure(v, args), lambda v, r: line(v, r, began))
    report = analyse({v: summary(rs) for v, rs in runs.items()}, args.sizes, args.actors)
    print(table(report))
    report = {
        "what": " ".join("\n\n".join(__doc__.split("\n\n")[:3]).split()),
        "command": "python bench/scale.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%F %R"),
        "args": vars(args),
        **report,
        "runs": runs,
    }
    publish(report, "targets", args.out)
    if args.out:
        plot(report, Path(args.out).with_suffix(".png"))
        print(f"written: {args.out} and {Path(args.out).with_suffix('.png')}")


if __name__ == "__main__":
    main()
