"""A worker's torch work off the step's thread, on a thread that ends with it: one OpenMP team per process.

OpenMP (libgomp, in torch's CPU wheels) gives each thread that starts a parallel region a team of its own and keeps
it while the thread lives. Once a process holds more of those threads than it has cores, every team spins ~100 times
instead of ~300,000 before it sleeps at a barrier, so each parallel region of the step waits for its threads to be
woken, and a core another process takes stalls the whole region. An actor's constructor runs on the process's main
thread and its calls on Ray's executor thread: a model built in the constructor left a second team behind, and the
step ran at 0.72x a plain torch loop's tokens/s (bench/models.py). A thread that ends frees its team.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future


def on_thread(name: str, fn, *args) -> Future:
    """`fn(*args)` on a new thread that ends when it returns: its result or its error, in the future. Not a daemon:
    a process that exits cleanly waits for a checkpoint write it started, as it did for the writer's pool thread."""
    out: Future = Future()

    def run() -> None:
        try:
            out.set_result(fn(*args))
        except BaseException as e:  # the caller's to raise, from the future
            out.set_exception(e)

    threading.Thread(target=run, name=name).start()
    return out
