"""Ranks of one gloo group as processes on this host, and what a rank holds: the tensor/pipeline layouts'
tests and benchmark run on these (etrain/core/parallel.py)."""

from __future__ import annotations

import io
import tempfile
import traceback
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from etrain.core.parallel import shard_of


def tensor_bytes(tensors) -> int:
    """Bytes this rank holds of `tensors` (its shard of a DTensor)."""
    return sum(shard_of(t).numel() * shard_of(t).element_size() for t in tensors)


class SavedBytes:
    """The bytes autograd keeps for backward, and their peak while this context is open: the activation memory,
    where (on CPU) the allocator keeps no statistics. Weights saved for backward are not activations: left out."""

    def __init__(self):
        self.now = self.peak = 0
        self._refs: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        if t.is_leaf and t.requires_grad:
            return t
        storage = shard_of(t).untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if not self._refs.get(key):
            self.now += size
            self.peak = max(self.peak, self.now)
        self._refs[key] = self._refs.get(key, 0) + 1
        held = _Held(t)
        weakref.finalize(held, self._release, key, size)
        return held

    @staticmethod
    def _unpack(held):
        return held.t if isinstance(held, _Held) else held

    def _release(self, key: int, size: int) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.now -= size


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.t = t


# What every rank imports, imported once in the fork server that forks the ranks: a spawned rank paid ~4 s of CPU
# for them (torch, and torch._dynamo through the optimizer), four ranks to a call, on two cores.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.tensor", "etrain.core.local_ranks"]


def rank_context():
    """Where rank processes come from: a fork server with PRELOAD imported (taken when it starts, once a process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def local_group(world: int, fn, *args) -> dict[int, object]:
    """rank -> fn(rank, world, *args), each rank a process of one gloo group on this host: the layouts' tests and
    benchmark. A rank that fails fails the call, with its traceback."""
    ctx = rank_context()
    out = ctx.Queue()
    meeting = tempfile.TemporaryDirectory(prefix="etrain-ranks-")  # ranks meet at a file: no port to lose to a race
    meet = str(Path(meeting.name) / "meet")
    procs = [ctx.Process(target=_local_rank, args=(r, world, meet, fn, args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, ok, value = out.get(timeout=600)
            if not ok:
                raise RuntimeError(f"rank {rank} of {world} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=True)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        meeting.cleanup()
    return results


def _local_rank(rank: int, world: int, meet: str, fn, args, out) -> None:
    torch.set_num_threads(1)  # one core per rank: ranks share this host's cores
    try:
        dist.init_process_group("gloo", init_method=f"file://{meet}", rank=rank, world_size=world)
    except Exception:
        out.put((rank, False, traceback.format_exc()))
        return
    try:
        result = io.BytesIO()  # by value: a tensor shared by handle would die with this process
        torch.save(fn(rank, world, *args), result)
        out.put((rank, True, result.getvalue()))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()
