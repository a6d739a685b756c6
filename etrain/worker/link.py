"""A simulated network link (fault kind `link`): how long a collective of the bytes actually sent would take on a
link of a given bandwidth and latency, and a wait that makes it take that long.

This is a model, for drills and benchmarks on one machine, where every link is loopback: the bytes are the real
bytes each collective hands over, the time is the formula's (etrain/core/comm_model.py has the ring's bytes). A ring
over N ranks:

    all-reduce of B bytes:  2(N-1) hops of latency, and each rank puts 2(N-1)/N x B bytes on its link
    all-gather of B bytes a rank:  N-1 hops, and (N-1) x B bytes on each link

The link carries one collective at a time, in the order they are handed to it (DDP's buckets, in order), so a
bucket ready while the one before is still on the link waits for it. A collective finishes at the later of its real
end and its modelled one: the model slows a run down, never speeds it up.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from etrain.core.comm_model import seconds


class Link:
    """One rank's link: its collectives queued on it, each made to last what `seconds` says."""

    def __init__(self, gbps: float, latency_ms: float):
        self.gbps, self.latency_ms = gbps, latency_ms
        self.free_at = 0.0  # when the collective last handed over leaves the link
        self._lock = threading.Lock()
        self._thread: ThreadPoolExecutor | None = None

    def same(self, fault: dict) -> bool:
        return (self.gbps, self.latency_ms) == (fault["gbps"], fault["latency_ms"])

    def book(self, nbytes: int, world: int, collective: str = "allreduce") -> float:
        """A collective handed over now: when the link would finish it (perf_counter time)."""
        now = time.perf_counter()
        with self._lock:
            self.free_at = max(now, self.free_at) + seconds(nbytes, world, self.gbps, self.latency_ms, collective)
            return self.free_at

    def delay(self, future: torch.futures.Future, until: float) -> torch.futures.Future:
        """`future`'s result, once it has it and `until` has come (a DDP hook's future: the backward pass goes on)."""
        self._thread = self._thread or ThreadPoolExecutor(1, thread_name_prefix="link")
        out = torch.futures.Future()
        self._thread.submit(self._settle, future, until, out)
        return out

    def wait(self, until: float) -> None:
        """Block until `until` (a collective that has already ended for real: the outer step's)."""
        self._sleep(until)

    def _settle(self, future: torch.futures.Future, until: float, out: torch.futures.Future) -> None:
        try:
            value = future.wait()
        except Exception as e:  # DDP raises it in the backward pass
            out.set_exception(e)
            return
        self._sleep(until)
        out.set_result(value)

    def _sleep(self, until: float) -> None:
        left = until - time.perf_counter()
        if left > 0:
            time.sleep(left)
